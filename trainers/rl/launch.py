"""Run a TrainJob on Ray Train: a TorchTrainer with `rl.num_workers` data-parallel workers (gloo
on the CPU, NCCL with `use_gpu`), each calling trainers.rl.train.train with its rank. The only
module of trainers/ that imports Ray.

Without `ray.address` a local runtime starts with light settings (no dashboard, a small object
store, this machine's cores) so it fits beside a vLLM engine on two cores; it stays up for the
process (later phases reuse it). Rank 0's per-step metrics come back live through a Ray Queue to
`report` in this process (the loop logs them to MLflow); rank 0 writes the checkpoint, so on a
multi-node cluster `out_dir` must be on storage every node sees. `num_workers: 0` runs the same
function in this process, without Ray.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainers.rl.data import check_dataset, load_episodes
from trainers.rl.manifest import PolicyCheckpoint, load_checkpoint
from trainers.rl.train import TrainJob, train


@dataclass
class RayConfig:
    address: str | None = None  # a running cluster ("auto", "ray://host:10001"); None: start a local runtime
    dashboard: bool = False
    object_store_mb: int = 128  # the local runtime's object store (only metrics and configs travel)
    num_cpus: int | None = None  # the local runtime's CPUs; None: this machine's

    def __post_init__(self):
        if self.object_store_mb < 80:
            raise ValueError(f"object_store_mb must be >= 80 (Ray's minimum), got {self.object_store_mb}")


def ensure_ray(cfg: RayConfig) -> float:
    """Connect to `cfg.address`, or start a local runtime once; seconds it took (0 if up already)."""
    import ray

    if ray.is_initialized():
        return 0.0
    t0 = time.perf_counter()
    kwargs = {"include_dashboard": cfg.dashboard, "configure_logging": False, "log_to_driver": True}
    if cfg.address is None:
        kwargs |= {"object_store_memory": cfg.object_store_mb << 20, "num_cpus": cfg.num_cpus or os.cpu_count()}
        if not cfg.dashboard:  # Ray Train's placement-group cleaner asks the state API (served by the
            # dashboard) every second and warns each time it cannot: keep Ray's own loggers to errors
            kwargs["logging_config"] = ray.LoggingConfig(log_level="ERROR")
    # "local": a runtime of its own even where another is up (a `ray start` cluster, another
    # `loop run`'s): Ray's default for no address would join the newest one it finds
    ray.init(address=cfg.address or "local", **kwargs)
    if cfg.address is None:
        # Ray's own clients in this process (Ray Train's placement-group cleaner asks the state API)
        # look for "the" runtime: point them at ours while it is up, whatever RAY_ADDRESS said before
        _OURS.update(address=ray.get_runtime_context().gcs_address, before=os.environ.get("RAY_ADDRESS"))
        os.environ["RAY_ADDRESS"] = _OURS["address"]
    return time.perf_counter() - t0


_OURS: dict[str, str | None] = {}  # the RAY_ADDRESS this process set for the runtime it started, and before


def shutdown_ray() -> None:
    """Stop the local runtime (or leave the cluster) if this process started one."""
    import sys

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    if _OURS and os.environ.get("RAY_ADDRESS") == _OURS["address"]:  # the next local runtime is a new one
        if _OURS["before"] is None:
            del os.environ["RAY_ADDRESS"]
        else:
            os.environ["RAY_ADDRESS"] = _OURS["before"]
    _OURS.clear()


def run_training(job: TrainJob, ray_cfg: RayConfig, report: Callable[[int, dict], None] = lambda s, m: None
                 ) -> PolicyCheckpoint:
    """Train on Ray (or in this process when `num_workers` is 0); the checkpoint's manifest."""
    job = job.absolute()
    job.check()  # fail here, before any worker starts
    rl = job.rl
    load_episodes(check_dataset(job.dataset), rl.adv_estimator, rl.norm_adv_by_std, rl.min_group_size)
    if job.rl.num_workers == 0:
        return train(job, report)
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Empty, Queue

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ensure_ray(ray_cfg)
    # the metrics relay lives on this process's node: a worker node lost mid-step must not take it along
    queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=True)})
    trainer = TorchTrainer(
        _worker, train_loop_config={"job": job, "queue": queue},
        scaling_config=ScalingConfig(num_workers=rl.num_workers, use_gpu=rl.use_gpu,
                                     resources_per_worker=None if rl.use_gpu else {"CPU": 1},
                                     placement_strategy=rl.placement),
        torch_config=TorchConfig(backend="nccl" if rl.use_gpu else "gloo"),
        run_config=RunConfig(name=f"train-{Path(job.out_dir).name}",
                             storage_path=str(Path(job.out_dir).resolve().parent / ".ray-train")))
    done: dict = {}

    def fit() -> None:
        try:
            done["result"] = trainer.fit()
        except BaseException as e:  # re-raised below, in the caller's thread
            done["error"] = e

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    relay = True
    while relay:
        try:
            if not thread.is_alive() and queue.empty():
                break
            step, metrics = queue.get(timeout=0.5)
        except Empty:  # (a RayError as well, raised in the relay actor: first)
            continue
        except ray.exceptions.RayError:  # the relay is gone: the job's own outcome says why
            relay = False
            continue
        report(step, metrics)
    thread.join()
    if relay:
        ray.kill(queue.actor)
    if "error" in done:
        raise TrainingFailed(_why(done["error"])) from done["error"]
    return load_checkpoint(job.out_dir)


class TrainingFailed(RuntimeError):
    """The training phase failed on Ray (a worker died, its node left the cluster, the step raised);
    nothing was written (rank 0 writes the checkpoint last, renamed into place)."""


def _why(error: BaseException) -> str:
    """What went wrong, a lost worker or node said first: each rank's error (Ray Train's snippets,
    their last line), else the first line of each exception in the chain Ray wraps."""
    chain, e = [], error
    while e is not None and len(chain) < 8:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = "\n".join(chain)
    died = any(k in text for k in ("ActorDiedError", "NodeDiedError", "health check failed", "node has died",
                                   "Connection reset by peer"))
    ranks = re.findall(r"\[Rank (\d+) Error Snippet\]:\n(?:Traceback \(most recent call last\):\n(?:[ \t][^\n]*\n)*)?"
                       r"([^\n]+)", text)
    detail = "; ".join(f"rank {r}: {line[:200]}" for r, line in ranks) or " <- ".join(
        (c.splitlines() or [""])[0][:300] for c in chain)
    return "training on Ray failed: " + ("a worker died or its node left the cluster: " if died else "") + detail


def _worker(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    job: TrainJob = config["job"]
    threads = job.rl.threads_per_worker or max(1, (os.cpu_count() or 1) // ctx.get_local_world_size())
    torch.set_num_threads(threads)
    queue = config["queue"]
    report = (lambda step, metrics: queue.put((step, metrics))) if rank == 0 else (lambda step, metrics: None)
    train(job, report, rank=rank, world=world, device=str(ray.train.torch.get_device()),
          node=ray.get_runtime_context().get_node_id())
