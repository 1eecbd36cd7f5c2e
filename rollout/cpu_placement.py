"""Where the engine's processes run on a CPU machine: the worker's cores stay the worker's.

vLLM's CPU backend binds each worker's OpenMP threads to its own cores and "reserves" the rest
for the front end (the log's `reserved_cpus`), but it pins nothing else there: the API server,
the engine core and a client on the same machine float onto the worker's cores and preempt its
forward pass. And the engine core busy-waits (`sched_yield`) for up to 1 s after each worker
reply, so once it shares the reserved cores with the API server and the client it takes them.
Measured on 2 cores: first by hand, 5 rounds of 512 episodes against one server, pinning after
the warm-up:

    vLLM as is (floating, spinning)      45-67 episodes/s
    pinned, engine core spinning         11-19 episodes/s   (the spin starves the API server)
    pinned, engine core sleeping         73-75 episodes/s

then with `bench/collect.py` (median of 5 rounds; collection over HTTP / the bare offline engine):

    engine.cpu_front_end=shared          53.1 / 77.6 episodes/s   ratio 0.68
    engine.cpu_front_end=reserved        68.3 / 75.2, 72.8 / 74.3, 67.9 / 77.7   ratios 0.91, 0.98, 0.87

So the two go together: `apply_env` (before the engine starts) makes the engine core sleep on
vLLM's notify socket after 1 ms instead of spinning for 1 s (`rollout.vllm_plugin`), and
`pin_front_end` (once it has started) moves every process of the engine but the workers, and
the caller's client with `beside_front_end`, off the workers' cores. Both do nothing on a GPU
machine, where no worker is bound to cores.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

SPIN_ENV = "FLYWHEEL_ENGINE_CORE_SPIN_S"  # read by rollout.vllm_plugin in the engine core
WORKER_SPIN_ENV = "FLYWHEEL_WORKER_SPIN_S"  # and in the workers, where set (a fleet's replicas)
WORKER_NAME = "VLLM::Worker"  # vLLM's process title for its workers (their /proc/PID/comm)


def apply_env(spin_s: float | None) -> None:
    """Set the engine core's busy-wait (seconds) for engines started from now on; None: vLLM's 1 s."""
    if spin_s is None:
        os.environ.pop(SPIN_ENV, None)
    else:
        os.environ[SPIN_ENV] = repr(float(spin_s))


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip().startswith(WORKER_NAME)
    except OSError:
        return False


def _cpus_of(pids: list[int]) -> set[int]:
    """The union of the CPUs these processes may run on (ended ones left out)."""
    cpus: set[int] = set()
    for p in pids:
        try:
            cpus |= os.sched_getaffinity(p)
        except OSError:
            pass
    return cpus


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (sched_setaffinity takes a thread id; new threads inherit their creator's)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended
            pass


def pin_front_end(engine_root: int, *, include_root: bool = True, also: tuple[int, ...] = ()) -> set[int] | None:
    """Pin the processes under `engine_root` (itself too, with `include_root`) that are not vLLM
    workers, and the pids in `also`, to the cores no worker is bound to. Returns those cores, or
    None when there is nothing to do: no worker bound to a subset of the cores (a GPU machine),
    or no core left over."""
    tree = process_tree(engine_root)
    workers = [p for p in tree if _is_worker(p)]
    worker_cpus = _cpus_of(workers)
    front = os.sched_getaffinity(engine_root) - worker_cpus
    if not worker_cpus or not front:
        return None
    for p in [p for p in tree if p not in workers and (include_root or p != engine_root)] + list(also):
        _set_affinity(p, front)
    return front


@contextmanager
def beside_front_end(engine_root: int):
    """Run the calling process (every thread) on the front-end cores of the engine under
    `engine_root` for the block, as its client, then put it back where it was."""
    home = os.sched_getaffinity(0)
    cpus = pin_front_end(engine_root, include_root=False, also=(os.getpid(),))
    try:
        yield cpus
    finally:
        if cpus is not None:
            _set_affinity(os.getpid(), home)


@contextmanager
def spawning_engine(engine_root: int):
    """Start an engine inside the block, in the thread that spawns it: a spawned process inherits
    its spawning thread's CPUs, and vLLM binds a new worker to the first CPUs it is allowed, so a
    front end pinned off the workers would put the new worker on its own cores. The thread gets
    every core of the engine's processes for the spawn; if the front end was pinned, it is pinned
    again afterwards, the new engine's front end with it."""
    everything = _cpus_of(process_tree(engine_root))
    mine = os.sched_getaffinity(0)
    pinned = mine != everything
    os.sched_setaffinity(0, everything)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
        if pinned:
            pin_front_end(engine_root)
