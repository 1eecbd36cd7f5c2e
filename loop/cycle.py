"""`loop run`: cycles of collect -> build_dataset -> train -> requantize -> validate -> [speculator]
-> promote (the speculator phase when `speculator.enabled`: loop/speculator.py).

    state = LoopState.open(...)                       # loop/state.py: resume where a kill left off
    with endpoint(...) as ep:                          # one server for every cycle, hot-swapped
        for k in 1..loop.cycles: cycle(lp, k)          # each phase: timed, shown, written down

A cycle trains the full-precision weights of what the server serves now (or, with `loop.train_from:
learner`, a candidate rejected for want of proof: loop/learner.py) on traffic collected from it,
and promotes the result only through the KL gate; the next cycle collects from whatever serves then,
traced under its own weight version. Every phase's output is written to the state file as it
finishes, so a rerun of the same command skips it. MLflow: one parent run per `loop run`, one nested
run per cycle holding every phase's metrics, tags and artifacts.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loop.collect import CollectManifest
from loop.gate import Candidate, Verdict
from loop.state import CycleState, LoopState

PHASES = ("collect", "build_dataset", "train", "requantize", "validate", "speculator", "promote")


class Display:
    """One status line at each phase's start: cycle k/N, phase, elapsed, and the latest reward,
    eval success, KL and throughput (the train phase's own progress bar runs under it)."""

    def __init__(self, cycles: int):
        self.cycles, self.t0, self.numbers = cycles, time.perf_counter(), {}

    def note(self, **numbers) -> None:
        """Numbers for the next line (None: keep the last one)."""
        self.numbers |= {key: v for key, v in numbers.items() if v is not None}

    def show(self, k: int, phase: str, **numbers) -> None:
        self.note(**numbers)
        n, el = self.numbers, int(time.perf_counter() - self.t0)
        parts = [f"cycle {k}/{self.cycles}", f"{phase:<13}", f"{el // 60:02d}:{el % 60:02d}"]
        if "reward" in n:
            parts.append(f"reward {n['reward']:.2f}")
        if "success" in n:
            parts.append(f"eval success {n['success']:.1%}")
        if "kl" in n:
            parts.append(f"KL {n['kl']:.2e}")
        if "episodes_per_s" in n:
            parts.append(f"{n['episodes_per_s']:.1f} episodes/s")
        print("[loop] " + " | ".join(parts), flush=True)


@dataclass
class Loop:
    """What every cycle shares: the config, the state on disk, the server, the parent run."""
    cfg: object  # LoopConfig
    state: LoopState
    ep: object  # loop.collect.Endpoint
    tokenizer: str
    display: Display
    speculating: bool = False  # speculator.enabled: a draft for each new target (loop/speculator.py)
    deploying: bool = False  # and the server speculates with it (swapped in with its target)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)


def _phase(lp: Loop, c: CycleState, name: str, fn, load):
    """`fn()` once: a phase the state says is done returns its recorded output (via `load`)."""
    if name in c.done:
        return load(c.done[name])
    lp.display.show(c.k, name)
    t0 = time.perf_counter()
    out = fn()
    c.timings[name] = round(time.perf_counter() - t0, 2)
    c.done[name] = out.to_dict() if hasattr(out, "to_dict") else asdict(out)
    lp.state.save()
    return out


def cycle(lp: Loop, k: int) -> CycleState:
    """One cycle, each phase once (a rerun after a kill starts at the phase it was in)."""
    from loop.collect import NoTraffic, agent_collect_phase, collect_phase, dataset_phase, log_collect, traffic_phase
    from loop.gate import requantize_phase, validate_phase
    from loop.learner import next_learner, train_parent
    from loop.promotion import promote_phase, promotion_intent
    from loop.speculator import SpeculatorStep, speculator_step
    from loop.train import train_phase
    from pipelines.promote import AdminClient, Outcome
    from pipelines.traces_to_dataset import load_manifest
    from rollout.server.swap import layer_plan
    from trainers.rl.data import NoSignal
    from trainers.rl.manifest import PolicyCheckpoint

    cfg, c, run_dir = lp.cfg, lp.state.cycle(k), lp.run_dir
    serving = AdminClient(lp.ep.url, lp.ep.admin_token).status()
    served_fp = serving_parent(lp, serving)  # the full-precision weights of what serves now
    seed = cfg.collect.problem_seed + (k - 1) * cfg.loop.problem_seed_stride

    def collect() -> CollectManifest:
        if cfg.collect.source == "traffic":
            out = traffic_phase(cfg, lp.ep, lp.tokenizer, serving["weight_version"], traffic_since(lp.state))
            print(f"[loop] traffic window {out.started_at or 'start'} .. {out.until}: {out.episodes} rewarded episodes "
                  f"of weight version(s) {', '.join(map(str, out.weight_versions))}, mean reward {out.success:.3f}", flush=True)
            lp.display.note(reward=out.success)
            return out
        if cfg.task.agent:
            out = agent_collect_phase(cfg, lp.ep, seed)
        else:
            out = collect_phase(cfg, lp.ep, lp.tokenizer, problem_seed=seed)
        print(f"[loop] collected {out.episodes} episodes ({out.episodes_ok} ok) from weight version(s) "
              f"{', '.join(map(str, out.weight_versions))} in {out.seconds:.1f}s: {out.episodes_per_s:.1f} episodes/s, "
              f"success {out.success:.1%}, {out.retries} retries", flush=True)
        lp.display.note(reward=out.success, episodes_per_s=out.episodes_per_s)
        return out

    def build():
        dataset = dataset_phase(cfg, collected, lp.tokenizer, run_dir)
        dropped = {**dataset.dropped_rows, **dataset.dropped_episodes}
        others = dataset.kept_episodes - collected.episodes_ok
        print(f"[loop] dataset {dataset.path}: {dataset.train_episodes} train + {dataset.heldout_episodes} held-out "
              f"episodes in {dataset.groups} groups from {dataset.rows_read} trace rows"
              f"{f' ({others} more than collected: other traffic in the window)' if others > 0 else ''}; dropped "
              f"{', '.join(f'{k} {v}' for k, v in dropped.items() if v) or 'nothing'}", flush=True)
        log_collect(collected, dataset)
        return dataset

    try:
        collected = _phase(lp, c, "collect", collect, CollectManifest.from_dict)
    except NoTraffic as e:
        return finish(lp, c, "skipped", str(e))
    dataset = _phase(lp, c, "build_dataset", build, lambda d: load_manifest(d["path"]))
    if "train" not in c.done and not window_served_by(cfg, dataset, serving["checkpoint_sha256"]):
        return finish(lp, c, "no_signal", f"no episode of the window was served by the parent's weights "
                      f"({serving['checkpoint_sha256'][:12]}, {serving['path']}): not trained on")
    try:
        plan = layer_plan(serving["path"]) or ()  # what the server keeps in full precision, QAT too
        ckpt = _phase(lp, c, "train", lambda: train_phase(cfg, train_parent(cfg, lp.state, served_fp), dataset,
                                                          run_dir, plan), PolicyCheckpoint.from_dict)
    except NoSignal as e:
        return finish(lp, c, "no_signal", f"nothing to train on: {e}")
    cand = _phase(lp, c, "requantize", lambda: requantize_phase(
        cfg, ckpt, dataset.path, run_dir, serving=serving_folder(lp.ep)), Candidate.from_dict)

    def validate() -> Verdict:
        v = validate_phase(cfg, cand, lp.ep, run_dir, tags={"loop_id": lp.state.loop_id, "loop_cycle": k})
        show_episodes(cfg, lp.tokenizer, dataset.path, v.summary.get("episode_kl", {}), k)
        return v

    verdict = _phase(lp, c, "validate", validate, Verdict.from_dict)
    lp.display.note(success=verdict.summary.get("candidate_success"), kl=verdict.summary.get("kl_drift_mean"))
    draft = None
    if lp.speculating:
        spec = _phase(lp, c, "speculator", lambda: speculator_step(lp, k, collected, verdict, cand),
                      SpeculatorStep.from_dict)
        draft = spec if spec.target in ("candidate", "offline") else None

    def promote():
        if verdict.passed and c.intent is None:  # written down before the swap (STYLE 16)
            c.intent = promotion_intent(cfg, verdict, lp.ep)
            lp.state.save()
        out = promote_phase(cfg, verdict, lp.ep, draft_path=draft.draft if draft and lp.deploying else None,
                            plan=c.intent)
        if out.status == "serving":  # saved with the phase: a restarted server starts on it
            lp.state.serving = {"path": cand.path, "fp": cand.fp or cand.path, "version": str(out.version)}
            if draft:  # the next draft warm-starts from it
                lp.state.serving |= {"draft": draft.draft, "draft_offline": draft.offline["rate"]}
        lp.state.learner = next_learner(cfg, k, verdict.summary, verdict.passed, verdict.reasons, ckpt.path,
                                        served_fp, out.status)
        if lp.state.learner:
            print(f"[loop] the candidate stays the learner: rejected for want of proof at paired delta "
                  f"{lp.state.learner['delta']:+.3f} (loop.train_from: learner)", flush=True)
        return out

    outcome = _phase(lp, c, "promote", promote, lambda d: Outcome(**d))
    reason = outcome.reason or ("; ".join(verdict.reasons) if not verdict.passed else "passed the gate and the canary")
    return finish(lp, c, outcome.status, reason)


def traffic_since(state: LoopState) -> str | None:
    """Where the next traffic window starts: the last traffic window's end (None: the first)."""
    ends = [c.done["collect"].get("until") for c in state.cycles if "collect" in c.done]
    return next((e for e in reversed(ends) if e), None)


def serving_parent(lp: Loop, status: dict) -> str:
    """The full-precision weights of what the server serves now (its /admin/status), not of what the
    state last recorded: a `loop rollback` or a restarted external server changes what serves. The
    state follows the server, said when it moved."""
    from loop.gate import fp_of
    from rollout.server.tracing import quant_format

    def same(a, b) -> bool:
        return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()

    state = lp.state.serving
    if same(status["path"], state["path"]):
        return state["fp"]
    fp = fp_of(status["path"]) or (status["path"] if quant_format(status["path"]) == "none" else None)
    if fp is None:
        raise RuntimeError(f"the server serves {status['path']}, whose full-precision weights are unknown (no "
                           "manifest parent): the loop cannot train what serves")
    if same(fp, state["fp"]):  # the served (quantized) copy of the state's policy
        return fp
    print(f"[loop] the server serves {status['path']} (weight version {status['weight_version']}), not "
          f"{state['path']} as the state said (a rollback, a promotion killed before it was "
          f"recorded, or another server): training from {fp}", flush=True)
    lp.state.serving = {"path": status["path"], "fp": fp, "version": None}
    lp.state.save()
    return fp


def window_served_by(cfg, dataset, sha: str) -> bool:
    """Whether any trace of the dataset's weight versions was served by weights `sha`; with
    `collect.max_staleness` on traffic, a window of only the versions before it is trained on too
    (by design: importance-corrected against the logprobs they were served with)."""
    from rollout.traces import read_traces

    if cfg.collect.source == "traffic" and cfg.collect.max_staleness > 0:
        return True
    t = read_traces(cfg.serve.trace_root, weight_versions=dataset.weight_versions, columns=["checkpoint_sha256"])
    return sha in set(t["checkpoint_sha256"].to_pylist())


def serving_folder(ep) -> str:
    """The folder the server runs now (the base's quantized copy, or the last promoted)."""
    from pipelines.promote import AdminClient

    return AdminClient(ep.url, ep.admin_token).status()["path"]


def show_episodes(cfg, tokenizer: str, dataset: str, episode_kl: dict, k: int) -> None:
    """The cycle's best and worst held-out episodes as MLflow traces (loop/episodes.py). A
    tracing failure costs the sample, said here, not the cycle."""
    import mlflow

    from loop.episodes import log_episodes

    run = mlflow.active_run()
    try:
        ids = log_episodes(cfg.serve.trace_root, tokenizer, dataset, episode_kl, k, run.info.run_id,
                           run.info.experiment_id, cfg.task.load().tools)
    except Exception as e:  # noqa: BLE001 (MLflow's tracing raises its own kinds)
        print(f"[loop] episodes not logged as MLflow traces: {type(e).__name__}: {e}", flush=True)
        return
    mlflow.log_metric("episodes/traces_logged", len(ids))
    print(f"[loop] {len(ids)} held-out episodes (best and worst of each group) logged as MLflow traces", flush=True)


def finish(lp: Loop, c: CycleState, outcome: str, reason: str) -> CycleState:
    """The cycle's outcome, metrics and timings into its run and the state; the loop's plot."""
    import mlflow

    c.outcome, c.reason = outcome, reason
    summary = c.done.get("validate", {}).get("summary", {})
    mlflow.log_metrics({f"time/{k}": v for k, v in c.timings.items()} | {"time/cycle": sum(c.timings.values())})
    mlflow.set_tags({"outcome": outcome, "outcome_reason": reason[:4000]})
    lp.state.save()
    print(f"[loop] cycle {c.k}/{lp.display.cycles}: {outcome} ({reason}); eval success "
          f"{_pct(summary.get('candidate_success'))} vs serving {_pct(summary.get('serving_success'))}; "
          f"{sum(c.timings.values()):.0f}s ({', '.join(f'{p} {s:.0f}s' for p, s in c.timings.items())})", flush=True)
    return c


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def success_by_cycle(state: LoopState) -> list[dict]:
    """Per finished cycle: the eval success of the candidate and of what serves after the cycle
    (cycle 0: the base as served, known from the first cycle that reached validate; none before)."""
    summaries = [c.done.get("validate", {}).get("summary", {}) for c in state.cycles]
    served = next((s["serving_success"] for s in summaries if s.get("serving_success") is not None), None)
    if served is None:
        return []
    rows = [{"cycle": 0, "served": served, "candidate": None, "outcome": "base"}]
    for c, s in zip(state.cycles, summaries):
        if c.finished:
            if c.outcome == "serving" and s.get("candidate_success") is not None:
                served = s["candidate_success"]
            rows.append({"cycle": c.k, "served": served, "candidate": s.get("candidate_success"), "outcome": c.outcome})
    return rows


def log_loop_summary(state: LoopState, temperature: float) -> None:
    """Into the parent run: success by cycle (metrics and plot) and the cycle x phase seconds."""
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow

    rows = success_by_cycle(state)
    run_id = mlflow.active_run().info.run_id
    logged = {m.step for m in mlflow.tracking.MlflowClient().get_metric_history(run_id, "success/served")}
    for r in rows:
        if r["cycle"] in logged:  # each cycle once, also across a resume
            continue
        mlflow.log_metric("success/served", r["served"], step=r["cycle"])
        if r["candidate"] is not None:
            mlflow.log_metric("success/candidate", r["candidate"], step=r["cycle"])
    mlflow.log_dict({f"cycle {c.k}": c.timings for c in state.cycles}, "cycle_timings.json")
    mlflow.log_dict(rows, "success_by_cycle.json")
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["cycle"] for r in rows], [r["served"] for r in rows], marker="o", color="#4a7", label="served")
    colors = {"serving": "#4a7", "rejected": "#c55", "rolled_back": "#d93", "swap_refused": "#d93"}
    for r in rows:
        if r["candidate"] is not None:
            ax.scatter(r["cycle"], r["candidate"], marker="x", s=60, color=colors.get(r["outcome"], "#888"))
    ax.scatter([], [], marker="x", color="#888", label="candidate (red: rejected)")
    ax.set(xlabel="cycle (0: the base as served)", ylabel=f"eval success at T={temperature}",
           title="success by cycle (quantized, served by vLLM)")
    ax.set_xticks([r["cycle"] for r in rows])
    ax.grid(alpha=0.3)
    ax.legend()
    with tempfile.TemporaryDirectory() as d:
        fig.savefig(Path(d) / "success_by_cycle.png", dpi=120, bbox_inches="tight")
        mlflow.log_artifact(str(Path(d) / "success_by_cycle.png"), artifact_path="plots")
    plt.close(fig)


def next_weight_version(trace_root: str | Path) -> int:
    """One past the highest weight version the trace root holds (0 when it holds none): a server
    restarted on another checkpoint never reuses a version number."""
    import pyarrow.compute as pc

    from rollout.traces import read_traces

    if not (Path(trace_root) / "traces").is_dir():
        return 0
    table = read_traces(trace_root, columns=["weight_version"])
    top = pc.max(table["weight_version"]).as_py() if table.num_rows else None
    return 0 if top is None else int(top) + 1


def sweep_partial(run_dir: Path) -> list[str]:
    """Folders a killed phase was still writing (`.<name>.tmp-<pid>`): removed before resuming."""
    gone = []
    for sub in ("datasets", "checkpoints", "served", "drafts"):
        for p in (run_dir / sub).glob(".*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(str(p))
    return gone


def serving_start(cfg, state: LoopState, base_path: str) -> dict:
    """What the server starts on: the state's serving policy, else the registry's `serving`
    version (a later `loop run` continues from it), else the base."""
    if state.serving:
        return state.serving
    from pipelines.promote import Registry

    v = Registry(cfg.tracking_uri, cfg.promote.model_name).alias("serving")
    if v is not None and (Path(Registry.path_of(v)) / "config.json").is_file():
        fp = v.tags.get("fp_path") or None
        if fp and (Path(fp) / "config.json").is_file():
            return {"path": Registry.path_of(v), "fp": fp, "version": str(v.version)}
    return {"path": base_path, "fp": base_path, "version": None}


def with_weight_version(cfg, version: int):
    return dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, weight_version=version))

