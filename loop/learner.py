"""Which weights a cycle trains: what serves, or the learner the gate turned away for want of proof.

    parent = train_parent(cfg, state, served_fp)         # the next train phase's starting weights
    state.learner = next_learner(cfg, k, verdict.summary, verdict.passed, verdict.reasons,
                                 ckpt.path, served_fp, outcome)       # after promote

The gate decides what serves; it need not decide what keeps learning. With `loop.train_from:
learner` a candidate rejected only by the success test, and measured no worse than serving by more
than `validate.min_success_delta` (its point estimate; its lower bound is what fell short), stays
the learner: the next cycle trains it further on the traffic serving collected (the trainer's
rollout correction weighs that older behaviour) instead of starting over from serving. Without it,
a candidate as good as serving is rejected about half the time at 200 paired problems and its
cycle of training is thrown away. (AlphaGo Zero ran its learner the same way: the evaluator gated
the self-play player, not the optimizer.) Anything else resets the learner to serving: a promotion,
a candidate the gate measured worse or failed on damage, drift, the engine check or the floor, a
rollback, or a server that moved to other weights.
"""

from __future__ import annotations

from pathlib import Path

TRAIN_FROM = ("serving", "learner")


def train_parent(cfg, state, served_fp: str) -> str:
    """The full-precision weights the next train phase starts from."""
    lr = state.learner
    if cfg.loop.train_from != "learner" or not lr:
        return served_fp
    if lr.get("serving_fp") != served_fp or not (Path(lr["fp"]) / "config.json").is_file():
        print(f"[loop] the learner {lr['fp']} grew on {lr.get('serving_fp')}, which no longer serves (or is gone): "
              f"training from {served_fp}", flush=True)
        state.learner = {}
        state.save()
        return served_fp
    print(f"[loop] training the learner {lr['fp']} (cycle {lr['cycle']}'s candidate, rejected at paired delta "
          f"{lr['delta']:+.3f}), not the serving weights: validate decides what serves", flush=True)
    return lr["fp"]


def next_learner(cfg, k: int, summary: dict, passed: bool, reasons: list, ckpt_path: str, served_fp: str,
                 outcome: str) -> dict:
    """The learner after cycle k's promote phase ({} = train from serving next)."""
    if cfg.loop.train_from != "learner" or outcome != "rejected" or passed:
        return {}
    delta = summary.get("success_delta")
    if summary.get("success_failed") and len(reasons) == 1 and delta is not None \
            and round(delta, 12) >= cfg.validate.min_success_delta:
        return {"fp": str(ckpt_path), "serving_fp": str(served_fp), "cycle": k, "delta": float(delta)}
    return {}
