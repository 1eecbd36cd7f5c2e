"""The loop, one phase a line, each timed.

    bootstrap -> collect -> build_dataset -> train -> requantize -> validate -> promote

Each phase is a function from a typed artifact (a manifest dataclass) to the next. One server (a
`loop serve` child, or `collect.endpoint`) serves the whole cycle: the traffic is collected from
it and the promoted checkpoint is hot-swapped into it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from loop.bootstrap import BaseModelManifest, bootstrap, evaluate_with_vllm
from loop.collect import CollectManifest, Endpoint, collect_phase, dataset_phase, endpoint, log_collect
from loop.config import LoopConfig
from loop.gate import promote_phase, requantize_phase, validate_phase
from loop.train import train_phase
from trainers.rl.data import NoSignal


@contextmanager
def phase(name: str, timings: dict):
    print(f"[loop] {name} ...", flush=True)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 2)
    print(f"[loop] {name} done in {timings[name]:.1f}s", flush=True)


def bootstrap_phase(cfg: LoopConfig) -> BaseModelManifest:
    """The base model (built or reused), its base success measured on vLLM, logged to MLflow."""
    import mlflow

    from loop.tracking import log_curve, start_run

    timings: dict = {}
    with phase("bootstrap", timings):
        base = bootstrap(cfg.bootstrap, cfg.task)
    if not base.eval:
        with phase("evaluate base on vLLM", timings):
            evaluate_with_vllm(base, cfg.task, cfg.engine)
    print(f"[loop] base model {base.path}: {base.num_parameters / 1e6:.2f}M parameters, "
          f"{base.sft_steps} SFT steps ({base.sft_seconds:.0f}s); success on {base.eval.get('num_problems')} "
          f"eval problems via vLLM: greedy {base.eval.get('vllm_greedy', float('nan')):.1%}, "
          f"T=1.0 {base.eval.get('vllm_t1', float('nan')):.1%}")
    with start_run(cfg, "bootstrap", tags={"phase": "bootstrap", "base_key": base.key}):
        client, run_id = mlflow.tracking.MlflowClient(), mlflow.active_run().info.run_id
        now = int(time.time() * 1000)
        metrics = [mlflow.entities.Metric(k, v, now, h["step"]) for h in base.sft_history
                   for k, v in h.items() if k != "step"]
        for i in range(0, len(metrics), 900):
            client.log_batch(run_id, metrics=metrics[i:i + 900])
        mlflow.log_metrics({f"base/{k}": v for k, v in base.eval.items() if isinstance(v, (int, float))})
        mlflow.log_metrics({"base/num_parameters": base.num_parameters, "base/sft_seconds": base.sft_seconds,
                            **{f"time/{k}": v for k, v in timings.items()}})
        mlflow.log_dict(base.files_sha256, "base_model_sha256.json")
        log_curve(base.sft_history, "sft/loss", "sft_loss.png", "SFT loss (assistant tokens)")
        log_curve(base.sft_history, "sft/eval_success", "sft_success.png",
                  f"SFT: success at T={cfg.bootstrap.sft.eval_temperature}")
    return base


def collect_and_build(cfg: LoopConfig, base: BaseModelManifest, ep: Endpoint) -> tuple[CollectManifest, object]:
    """Traffic through the endpoint (the base model served) -> an RL dataset, one MLflow run."""
    import mlflow

    from loop.tracking import start_run

    timings: dict = {}
    with start_run(cfg, "collect", tags={"phase": "collect", "base_key": base.key}):
        with phase("collect", timings):
            collected = collect_phase(cfg, ep, base.path)
        print(f"[loop] collected {collected.episodes} episodes ({collected.episodes_ok} ok) in "
              f"{collected.seconds:.1f}s: {collected.episodes_per_s:.1f} episodes/s, success {collected.success:.1%}, "
              f"{collected.retries} retries", flush=True)
        with phase("build_dataset", timings):
            dataset = dataset_phase(cfg, collected, str(base.path), Path(cfg.run_dir))
        dropped = {**dataset.dropped_rows, **dataset.dropped_episodes}
        others = dataset.kept_episodes - collected.episodes_ok
        print(f"[loop] dataset {dataset.path}: {dataset.train_episodes} train + {dataset.heldout_episodes} held-out "
              f"episodes in {dataset.groups} groups from {dataset.rows_read} trace rows"
              f"{f' ({others} more than collected: other traffic in the window)' if others > 0 else ''}; dropped "
              f"{', '.join(f'{k} {v}' for k, v in dropped.items() if v) or 'nothing'}", flush=True)
        log_collect(collected, dataset)
        mlflow.log_metrics({f"time/{k}": v for k, v in timings.items()})
    return collected, dataset


def run(cfg: LoopConfig) -> int:
    base = bootstrap_phase(cfg)
    run_dir = Path(cfg.run_dir)
    timings: dict = {}
    with endpoint(cfg, base.path, run_dir) as ep:
        _, dataset = collect_and_build(cfg, base, ep)
        try:
            with phase("train", timings):
                ckpt = train_phase(cfg, base.path, dataset, run_dir)
        except NoSignal as e:
            print(f"[loop] nothing to train on, no new checkpoint this cycle: {e}", flush=True)
            return 0
        with phase("requantize", timings):
            candidate = requantize_phase(cfg, ckpt, dataset.path, run_dir)
        with phase("validate", timings):
            gate, version, registry, server = validate_phase(cfg, candidate, ep, run_dir)
        with phase("promote", timings):
            outcome = promote_phase(cfg, gate, version, registry, server)
    path_s = sum(timings[k] for k in ("requantize", "validate", "promote"))
    print(f"[loop] cycle done: {outcome.status} (registry v{outcome.version}); requantize -> validate -> promote "
          f"took {path_s:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in timings.items())})", flush=True)
    return 0
