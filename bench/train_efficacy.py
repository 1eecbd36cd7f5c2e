"""Does one train phase make the checkpoint better *as served*? Success on the task's eval split
(200 problems by default) through vLLM at T=1.0, before and after one train phase of the default
config on the base model's rollouts, for each format this machine serves (full precision and the
quantized ones), trained with QAT (through the auto serving format's spec) and without.

    python bench/train_efficacy.py [--dataset DIR] [--config conf/agent_rl.yaml] [key=value ...]

The dataset defaults to the newest under the config's run_dir (`loop run` makes one); each
evaluation runs its own vLLM engine in a child process (loop/evaluate.py). Prints one table and
the JSON; the issue's target: quantized-after minus quantized-base >= 10 points.
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
    formats = ["none"] + [f for f in ("w4a16", "w8a8") if caps.can_serve(f)]
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
    table: dict = {}
    for f in formats:
        for name, path in models.items():
            r = served_success(a.config, path, f, a.overrides)
            table[(f, name)] = r["T=1.0"]
            print(f"{f:>6} {name:>7}: {r['T=1.0']:.1%}", flush=True)
    out = {"cpu": caps.describe(), "kernel_build": caps.kernel_build, "auto_format": fmt, "dataset": a.dataset,
           "train": train_s, "success_T1": {f"{f}/{n}": v for (f, n), v in table.items()},
           "num_problems": cfg.task.num_eval_problems}
    print(json.dumps(out, indent=2))
    print(f"\nsuccess at T=1.0 on {cfg.task.num_eval_problems} eval problems, served by vLLM ({caps.describe()})")
    print(f"{'served as':>10} | {'base':>6} | {'QAT':>6} | {'no QAT':>6} | QAT - base")
    for f in formats:
        b, q, n = table[(f, "base")], table[(f, "qat")], table[(f, "no_qat")]
        print(f"{f:>10} | {b:6.1%} | {q:6.1%} | {n:6.1%} | {100 * (q - b):+.1f} points")
    if "qat" in train_s:
        print(f"train phase (QAT through {fmt}): {train_s['qat']['wall_s']:.0f} s wall, "
              f"{train_s['qat']['step_s']:.0f} s in {train_s['qat']['steps']} optimizer steps")


if __name__ == "__main__":
    main()
