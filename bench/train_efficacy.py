"""Does one train phase make the checkpoint better *as served*? Success on the task's eval split
(200 problems by default) through vLLM at T=1.0, before and after one train phase of the default
config on the base model's rollouts, for each format this machine serves (full precision and the
quantized ones), trained with QAT (through the auto serving format's spec) and without.

    python bench/train_efficacy.py [key=value ...] [--dataset DIR] [--config conf/agent_rl.yaml]
                                   [--seeds 0 1 2] [--formats none w4a16]

The dataset defaults to the newest under the config's run_dir (`loop run` makes one); each
evaluation runs its own vLLM engine in a child process (loop/evaluate.py), once per sampling seed
(`engine.seed`). Prints one table and the JSON. Beside each quantized format, what QAT recovers of
the no-QAT checkpoint's loss to quantization ("PTQ loss": no-QAT served in full precision minus
no-QAT quantized; "recovered": (QAT quantized - no-QAT quantized) / PTQ loss), with 90% intervals
over the seeds (paired by seed). `serve.w4a16_group_size=null` serves and trains W4A16 per channel,
the coarsest (lossiest) W4A16 vLLM's CPU kernel runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset")
    ap.add_argument("--config", default=str(REPO / "conf" / "agent_rl.yaml"))
    ap.add_argument("--qat", help="a checkpoint already trained with QAT (skips training it)")
    ap.add_argument("--no-qat", help="a checkpoint already trained without QAT")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="engine.seed of each evaluation")
    ap.add_argument("--formats", nargs="+", choices=["none", "w4a16", "w8a8"],
                    help="served formats to evaluate (default: none and every quantized format this machine serves)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    from loop.bootstrap import bootstrap
    from loop.config import load_config
    from loop.evaluate import served_success
    from loop.train import qat_spec
    from rollout.capabilities import detect
    from trainers.rl.launch import run_training
    from trainers.rl.train import TrainJob

    cfg = load_config(a.config, a.overrides)
    if a.dataset is None:
        found = sorted((Path(cfg.run_dir) / "datasets").glob("*/flywheel_manifest.json"))
        if not found:
            sys.exit(f"no dataset under {cfg.run_dir}/datasets: run `loop run {a.config}` first, or pass --dataset")
        a.dataset = str(found[-1].parent)
    base = bootstrap(cfg.bootstrap, cfg.task).path
    caps = detect()
    fmt, spec = qat_spec(cfg)
    formats = a.formats or ["none"] + [f for f in ("w4a16", "w8a8") if caps.can_serve(f)]
    tmp = Path(tempfile.mkdtemp(prefix="fw-efficacy-"))
    models, train_s = {"base": base}, {}
    for name, qat in (("qat", True), ("no_qat", False)):
        if getattr(a, name):
            models[name] = getattr(a, name)
            continue
        t0 = time.perf_counter()
        ckpt = run_training(TrainJob(base, a.dataset, str(tmp / name), dataclasses.replace(cfg.trainer, qat=qat), spec),
                            cfg.ray)
        train_s[name] = {"wall_s": round(time.perf_counter() - t0, 1), "job_s": ckpt.wall_seconds,
                         "step_s": ckpt.metrics["step_seconds"], "steps": ckpt.metrics["steps"]}
        models[name] = ckpt.path
    table: dict = {}  # (format, model) -> success per seed
    for f in formats:
        for name, path in models.items():
            table[(f, name)] = [served_success(a.config, path, f, [*a.overrides, f"engine.seed={s}"])["T=1.0"]
                                for s in a.seeds]
            print(f"{f:>6} {name:>7}: " + " ".join(f"{v:.1%}" for v in table[(f, name)]), flush=True)
    out = {"cpu": caps.describe(), "kernel_build": caps.kernel_build, "auto_format": fmt, "qat_spec": spec,
           "dataset": a.dataset, "train": train_s, "seeds": a.seeds,
           "success_T1": {f"{f}/{n}": v for (f, n), v in table.items()}, "num_problems": cfg.task.num_eval_problems}
    print(json.dumps(out, indent=2))
    print(f"\nsuccess at T=1.0 on {cfg.task.num_eval_problems} eval problems, served by vLLM ({caps.describe()}), "
          f"mean over engine seeds {a.seeds}")
    print(f"{'served as':>10} | {'base':>6} | {'QAT':>6} | {'no QAT':>6} | QAT - base")
    for f in formats:
        b, q, n = (mean(table[(f, m)]) for m in ("base", "qat", "no_qat"))
        print(f"{f:>10} | {b:6.1%} | {q:6.1%} | {n:6.1%} | {100 * (q - b):+.1f} points")
    if "none" in formats and fmt in formats and fmt != "none":  # QAT trained through `fmt`'s spec
        loss = [100 * (x - y) for x, y in zip(table[("none", "no_qat")], table[(fmt, "no_qat")])]
        gain = [100 * (x - y) for x, y in zip(table[(fmt, "qat")], table[(fmt, "no_qat")])]
        (lm, llo, lhi), (gm, glo, ghi) = interval(loss), interval(gain)
        print(f"{fmt}: PTQ loss {lm:+.1f} points [{llo:+.1f}, {lhi:+.1f}], QAT - PTQ {gm:+.1f} [{glo:+.1f}, {ghi:+.1f}]"
              + (f", recovered {gm / lm:.0%}" if lm >= 3 else " (PTQ loses < 3 points: nothing to recover)"))
    if "qat" in train_s:
        print(f"train phase (QAT through {fmt}): {train_s['qat']['wall_s']:.0f} s wall, "
              f"{train_s['qat']['step_s']:.0f} s in {train_s['qat']['steps']} optimizer steps")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and a 90% t-interval over seeds (the mean alone for one seed)."""
    m, n = mean(xs), len(xs)
    if n < 2:
        return m, m, m
    t95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015}.get(n - 1, 1.96)
    half = t95 * (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5 / n ** 0.5
    return m, m - half, m + half


if __name__ == "__main__":
    main()
