"""`loop run`: the base model once, then `loop.cycles` cycles on one server (loop/cycle.py).

    bootstrap -> [collect -> build_dataset -> train -> requantize -> validate -> promote] x N

Each phase is a function from a typed artifact (a manifest dataclass) to the next. One server (a
`loop serve` child, or `collect.endpoint`) serves every cycle: the traffic is collected from it
and each promoted checkpoint is hot-swapped into it. The run's state is on disk: the same command
after a kill (or Ctrl-C) continues from the phase it was in.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from loop.bootstrap import BaseModelManifest, bootstrap, evaluate_with_vllm
from loop.config import LoopConfig


@contextmanager
def phase(name: str, timings: dict):
    print(f"[loop] {name} ...", flush=True)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 2)
    print(f"[loop] {name} done in {timings[name]:.1f}s", flush=True)


def bootstrap_phase(cfg: LoopConfig, log: bool = True) -> BaseModelManifest:
    """The base model (built or reused), its base success measured on vLLM, logged to MLflow
    (when `log`: a run of its own, or a child of the active one)."""
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
    if not log:
        return base
    with mlflow.start_run(run_name="bootstrap", nested=True, tags={"phase": "bootstrap", "base_key": base.key}) \
            if mlflow.active_run() else start_run(cfg, "bootstrap", tags={"phase": "bootstrap", "base_key": base.key}):
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


def run(cfg: LoopConfig) -> int:
    """Resume the unfinished run in cfg.run_dir, or start one; run its cycles; 0 when all ran."""
    from loop.collect import endpoint
    from loop.configs import flatten, to_dict
    from loop.gate import ServingFailsOnStack
    from loop.cycle import (Display, Loop, cycle, log_loop_summary, next_weight_version, serving_start,
                            sweep_partial, with_weight_version)
    from loop.speculator import deploys, initial_draft, serve_with_draft
    from loop.state import LoopState
    from loop.tracking import find_run, open_run
    from trainers.rl.launch import TrainingFailed, shutdown_ray

    run_dir = Path(cfg.run_dir)
    state = LoopState.open(run_dir, flatten(to_dict(cfg)))
    resumed = bool(state.cycles)
    if resumed:
        left = [c.k for c in state.cycles if not c.finished]
        print(f"[loop] resuming run {state.loop_id} at cycle {left[0] if left else len(state.cycles) + 1}"
              f"{' (removed ' + str(len(g)) + ' half-written folders)' if (g := sweep_partial(run_dir)) else ''}",
              flush=True)
    tags = {"loop_id": state.loop_id, "kind": "loop"}
    display = Display(cfg.loop.cycles)
    t0 = time.perf_counter()
    try:
        state.run_id = state.run_id or find_run(cfg, **tags)
        with open_run(cfg, f"loop {state.loop_id}", tags, run_id=state.run_id) as parent:
            state.run_id = parent.info.run_id
            state.save()
            base = bootstrap_phase(cfg, log=not state.base)
            state.base = state.base or {"path": str(base.path), "key": base.key, "eval": base.eval}
            state.serving = serving_start(cfg, state, str(base.path))
            serve_cfg = with_weight_version(cfg, next_weight_version(cfg.serve.trace_root))
            deploying = False
            if cfg.speculator.enabled:
                deploying, why_not = deploys(cfg)
                if deploying:  # the server speculates from its start: on the last draft, or a new one
                    state.serving.setdefault("draft", initial_draft(cfg, state.serving["fp"], run_dir))
                    serve_cfg = serve_with_draft(serve_cfg, state.serving["draft"])
                else:
                    print(f"[loop] speculator: {why_not}", flush=True)
            state.save()
            with endpoint(serve_cfg, state.serving["path"], run_dir) as ep:
                lp = Loop(cfg, state, ep, str(base.path), display, speculating=cfg.speculator.enabled,
                          deploying=deploying)
                for k in range(1, cfg.loop.cycles + 1):
                    c = state.cycle(k)
                    if c.finished:
                        continue
                    ctags = {"loop_id": state.loop_id, "loop_cycle": str(k)}
                    c.run_id = c.run_id or find_run(cfg, **ctags)
                    with open_run(cfg, f"cycle {k}", ctags, run_id=c.run_id, nested=True) as crun:
                        c.run_id = crun.info.run_id
                        state.save()
                        cycle(lp, k)
                    log_loop_summary(state, cfg.collect.rollout.temperature)
            state.finished = True
            state.save()
    except ServingFailsOnStack as e:
        print(f"[loop] stopped: {e}", flush=True)
        return 3
    except TrainingFailed as e:
        print(f"[loop] stopped: {e}\n[loop] nothing of the train phase was kept; the same command resumes the "
              f"run from it (state: {state.path})", flush=True)
        return 5
    except Exception as e:  # noqa: BLE001 (only the tracking server's silence is handled; the rest re-raises)
        from loop.tracking import unreachable

        if not unreachable(e):
            raise
        print(f"[loop] stopped: the MLflow tracking server {cfg.tracking_uri} did not answer "
              f"(mlflow.http_retries {cfg.mlflow.http_retries}): {str(e)[:400]}\n[loop] nothing is lost: the run's "
              f"state is in {state.path}; once the server is back, the same command resumes it", flush=True)
        return 4
    except KeyboardInterrupt:
        where = next((f"cycle {c.k}, after {list(c.done)[-1] if c.done else 'nothing'}" for c in state.cycles
                      if not c.finished), "between cycles")
        print(f"\n[loop] interrupted ({where}); the server and Ray are stopped. Run the same command to "
              f"continue: the state is in {state.path}", flush=True)
        return 130
    finally:
        shutdown_ray()
    served = [c for c in state.cycles if c.outcome == "serving"]
    print(f"[loop] {len(state.cycles)} cycles in {time.perf_counter() - t0:.0f}s: "
          f"{', '.join(f'{c.k} {c.outcome}' for c in state.cycles)}; serving {state.serving['path']}"
          f"{' (registry v' + str(state.serving['version']) + ')' if state.serving.get('version') else ''}; "
          f"{len(served)} promoted", flush=True)
    return 0
