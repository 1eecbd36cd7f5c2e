"""The loop's `train` phase: the RL dataset and the policy it was sampled from -> a trained
checkpoint, on Ray (trainers/rl/launch.py), QAT through the format this machine serves.

The serving format is the one `loop serve` would pick for `serve.quant` here (W4A16 on AVX-512
CPUs and CUDA, W8A8 on AVX2-only CPUs, none when serving full precision); QAT trains through its
exact QuantSpec. With nothing quantized to serve, QAT has nothing to match and is turned off (said
in the log and the run's tags). One MLflow run per phase: per-step metrics live, the summary, the
curves as plots and the checkpoint's manifest.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from loop.serving import serving_spec

CURVES = (("loss", "loss"), ("reward/mean", "reward of the minibatch's episodes"),
          ("mismatch/train_vs_behaviour", "mean |log pi_train - log pi_behaviour| (sampled tokens)"),
          ("is/mean", "truncated IS weight (mean)"), ("pg/pg_clipfrac", "PPO clip fraction"),
          ("entropy", "entropy (sampled positions)"), ("grad_norm", "grad norm (before clipping)"))


def qat_spec(cfg) -> tuple[str, dict | None]:
    """(serving format, its QuantSpec as a dict or None) for `serve.quant` on this machine."""
    from rollout.capabilities import detect

    fmt = detect().choose(cfg.serve.quant)
    dtype = cfg.serve.dtype if cfg.serve.dtype != "auto" else cfg.engine.dtype
    spec = serving_spec(fmt, cfg.serve.w4a16_group_size, "float16" if dtype == "float16" else "bfloat16")
    return fmt, None if spec is None else spec.to_dict()


def train_phase(cfg, parent: str, dataset, run_dir: Path, full_precision: tuple[str, ...] = ()):
    """Train `parent` on `dataset` (an RLDatasetManifest) into <run_dir>/checkpoints/<stamp>-<id>;
    `full_precision`: the linear layers the serving layer plan keeps unquantized (QAT leaves them so)."""
    import mlflow

    from loop.tracking import log_curve, start_run
    from trainers.rl.data import check_dataset, load_episodes
    from trainers.rl.launch import run_training
    from trainers.rl.train import TrainJob

    fmt, spec = qat_spec(cfg)
    rl = cfg.trainer
    if rl.qat and spec is None:
        print(f"[loop] serve.quant resolves to {fmt}: nothing quantized to train through, QAT off", flush=True)
        rl = dataclasses.replace(rl, qat=False)
    load_episodes(check_dataset(dataset.path), rl.adv_estimator, rl.norm_adv_by_std, rl.min_group_size)  # NoSignal
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(run_dir) / "checkpoints" / f"{stamp}-{uuid.uuid4().hex[:6]}"
    full_precision = tuple(n for n in full_precision if n != "lm_head" and not n.endswith(".lm_head"))
    job = TrainJob(parent=str(parent), dataset=dataset.path, out_dir=str(out), rl=rl, spec=spec,
                   full_precision=full_precision)
    with start_run(cfg, "train", tags={"phase": "train", "serving_format": fmt, "qat": str(rl.qat),
                                       "qat_full_precision": ",".join(full_precision) or "none",
                                       "dataset_path": dataset.path, "parent": str(parent)}):
        client, run_id = mlflow.tracking.MlflowClient(), mlflow.active_run().info.run_id

        def report(step: int, metrics: dict) -> None:
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[mlflow.entities.Metric(f"train/{k}", float(v), now, step)
                                              for k, v in metrics.items()])

        t0 = time.perf_counter()
        ckpt = run_training(job, cfg.ray, report)
        mlflow.log_metrics({"time/train": time.perf_counter() - t0,
                            **{f"train_summary/{k}": float(v) for k, v in ckpt.metrics.items()},
                            **{f"train_data/{k}": v for k, v in ckpt.data.items()}})
        mlflow.log_dict(ckpt.to_dict(), "checkpoint_manifest.json")
        mlflow.set_tag("checkpoint_path", ckpt.path)
        mlflow.set_tags({"adv_estimator": ckpt.adv_estimator, "adv_estimator_reason": ckpt.adv_estimator_reason})
        for key, title in CURVES:
            log_curve(ckpt.history, key, key.replace("/", "_") + ".png", f"train: {title}")
    m = ckpt.metrics
    print(f"[loop] checkpoint {ckpt.path}: {m['steps']} steps on {ckpt.data['episodes']} episodes, "
          f"{ckpt.adv_estimator} advantages ({ckpt.adv_estimator_reason}) "
          f"({ckpt.data['groups']} groups with signal; {ckpt.data.get('groups_all_equal_reward', 0)} all-equal left "
          f"out) in {ckpt.wall_seconds:.0f}s, {m['tokens_per_s']:.0f} sampled tokens/s; loss {m['loss_first']:.4f} -> "
          f"{m['loss_last']:.4f}, train/behaviour mismatch {m['mismatch_first']:.4f} -> {m['mismatch_last']:.4f}; "
          f"QAT {'through ' + fmt if rl.qat else 'off'}", flush=True)
    return ckpt
