"""Flywheel's vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml).

vLLM calls `register()` in each of its processes. In the engine core, and only when
`FLYWHEEL_ENGINE_CORE_SPIN_S` is set (`rollout.cpu_placement.apply_env`), it sets how long the
engine core busy-waits on the workers' shared-memory reply queue before it sleeps on the queue's
notify socket: vLLM hard-codes 1 s (`SpinCondition(busy_loop_s=1)`), which on a CPU machine takes
the cores the API server needs (see rollout/cpu_placement.py for the numbers). The workers keep
vLLM's spin: they are bound to their own cores.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from rollout.cpu_placement import SPIN_ENV

log = logging.getLogger("flywheel")


def register() -> None:
    value = os.environ.get(SPIN_ENV)
    if value is None or not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    try:
        spin_s = float(value)
    except ValueError:
        raise ValueError(f"{SPIN_ENV} must be a number of seconds, got {value!r}") from None
    set_engine_core_spin(spin_s)


def set_engine_core_spin(spin_s: float) -> None:
    """Make shared-memory queue readers created from now on in this process busy-wait `spin_s`."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)

    def __init__(self, is_reader, context, notify_address, busy_loop_s=spin_s):
        init(self, is_reader, context, notify_address, busy_loop_s)

    __init__.__wrapped__ = init
    cls.__init__ = __init__
    log.info("engine core: shared-memory queue busy-wait %.3g s (vLLM's default: 1 s)", spin_s)
