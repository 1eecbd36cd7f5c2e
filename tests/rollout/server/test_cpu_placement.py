"""CPU placement of the engine (rollout/cpu_placement.py, rollout/vllm_plugin.py) on the real
engines of the session: the worker keeps its cores, the front end runs on the others, and the
engine core stops busy-waiting through the worker's forward passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from srv_util import placement

from rollout import cpu_placement


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_vllm_discovers_the_plugin():
    from vllm.plugins import load_plugins_by_group

    from rollout.vllm_plugin import register

    assert load_plugins_by_group("vllm.general_plugins").get("flywheel") is register


def test_plugin_changes_the_queues_of_the_engine_processes_only():
    code = (
        "import itertools, multiprocessing, os, zmq\n"
        f"os.environ[{cpu_placement.SPIN_ENV!r}] = '0.001'\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "from rollout.vllm_plugin import register\n"
        "spin = lambda: SpinCondition(True, zmq.Context.instance(), 'ipc:///tmp/fw-spin-test').busy_loop_s\n"
        "n = itertools.count()\n"
        "hwm = lambda: SpinCondition(False, zmq.Context.instance(), f'ipc:///tmp/fw-hwm-{os.getpid()}-{next(n)}')"
        ".local_notify_socket.getsockopt(zmq.SNDHWM)\n"
        "register()\n"
        "elsewhere = spin(), hwm()\n"
        "multiprocessing.current_process().name = 'VllmWorker-0'\n"
        "register()\n"
        "worker = spin(), hwm()\n"
        "multiprocessing.current_process().name = 'EngineCore_DP0'\n"
        "register(); register()\n"  # vLLM may load plugins more than once
        "print(*elsewhere, *worker, spin(), hwm())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1", "1", "1024", "0.001", "1024"]


def _reader_waits(notify: str) -> list[float]:
    script = Path(__file__).with_name("shm_wakeup.py")
    out = subprocess.run([sys.executable, str(script), notify], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_sleeping_reader_gets_both_answers_of_a_step():
    """vLLM's notify socket drops the second of two notifications ~0.3 ms apart, so a reader asleep
    in between waits for the recheck (1 s in shm_wakeup.py, 5 s in vLLM): what stalled engine
    steps for seconds. With the plugin's high-water mark every notification arrives."""
    lost = [w for w in _reader_waits("vllm") if w > 0.5]
    assert lost, "vLLM's notify socket lost no wake-up: the premise of rollout/vllm_plugin.py no longer holds"
    waits = _reader_waits("flywheel")
    assert max(waits) < 0.25, f"a sleeping reader still waits for the recheck: {waits}"


def test_offline_engine_core_runs_off_the_worker_and_stops_spinning(tiny_llm, tiny_cfg):
    assert tiny_cfg.engine.cpu_front_end == "reserved"
    (proc,) = tiny_llm.llm_engine.engine_core.resources.engine_manager.processes  # the session may hold other engines
    worker_cpus, (engine_core,) = placement(proc.pid)
    if not worker_cpus:  # nothing to keep apart: placement leaves everything where it is
        assert cpu_placement.pin_front_end(proc.pid) is None
        return
    assert os.sched_getaffinity(engine_core) == os.sched_getaffinity(0) - worker_cpus
    assert os.sched_getaffinity(0) >= worker_cpus  # the caller itself is left where it was (it may train)

    from vllm import SamplingParams

    # With vLLM's 1 s busy-wait the engine core takes ~0.93 of a core through a generate call
    # (measured); sleeping after 1 ms, ~0.41 (its own scheduling and output work).
    prompts = [{"prompt_token_ids": [5 + i % 50] * 16} for i in range(64)]
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=1.0)
    tiny_llm.generate(prompts[:4], params, use_tqdm=False)
    c0, t0 = _cpu_seconds(engine_core), time.perf_counter()
    tiny_llm.generate(prompts, params, use_tqdm=False)
    share = (_cpu_seconds(engine_core) - c0) / (time.perf_counter() - t0)
    assert share < 0.7, f"engine core busy {share:.0%} of a core through generate: still spinning?"


def test_server_front_end_and_a_client_beside_it(srv_main):
    worker_cpus, (engine_core,) = placement(srv_main.proc.pid)
    if not worker_cpus:
        assert cpu_placement.pin_front_end(srv_main.proc.pid) is None
        return
    front = os.sched_getaffinity(srv_main.proc.pid)
    assert front and not front & worker_cpus
    assert os.sched_getaffinity(engine_core) == front
    home = os.sched_getaffinity(0)
    with cpu_placement.beside_front_end(srv_main.proc.pid) as cpus:
        assert cpus == front and os.sched_getaffinity(0) == front
    assert os.sched_getaffinity(0) == home
