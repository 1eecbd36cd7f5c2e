"""A real `kill -9` of a process appending traces: no acknowledged trace is lost or duplicated."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rollout.traces import TraceConfig, TraceWriter, read_traces

CHILD = Path(__file__).with_name("trace_child.py")


def _run_and_kill(root: Path, durability: str, interval: float, tag: str, n_acked: int,
                  run_s: float = 0.0) -> tuple[list, float]:
    """Start the child, SIGKILL it once it has acknowledged `n_acked` traces and `run_s` seconds
    have passed since the first; return its acknowledgements as (trace_id, monotonic time)
    and the time of the kill."""
    proc = subprocess.Popen([sys.executable, str(CHILD), str(root), durability, str(interval), tag],
                            stdout=subprocess.PIPE, text=True)
    acked: list = []

    def read():
        for line in proc.stdout:
            parts = line.split()
            if line.endswith("\n") and len(parts) == 2:  # a line cut by the kill is no ack
                acked.append((parts[0], float(parts[1])))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < deadline:
        if len(acked) >= n_acked and time.monotonic() - acked[0][1] >= run_s:
            break
        time.sleep(0.005)
    killed_at = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join()
    assert len(acked) >= n_acked, f"child acknowledged only {len(acked)} traces (rc {proc.returncode})"
    return acked, killed_at


def _stored_ids(root: Path) -> list[str]:
    with TraceWriter(TraceConfig(root=root)):  # replays what the dead writer left in the WAL
        pass
    return read_traces(root, columns=["trace_id"])["trace_id"].to_pylist()


def test_kill_9_loses_no_committed_trace(tmp_path, tr_make_trace):
    acked = []
    live = TraceWriter(TraceConfig(root=tmp_path, max_file_age_s=600))  # a writer that stays alive
    for round_, n in enumerate((150, 600, 300)):  # each child also replays the previous one's WAL
        acked += [tid for tid, _ in _run_and_kill(tmp_path, "commit", 1.0, f"r{round_}", n)[0]]
        live.append_sync(tr_make_trace(round_))
        acked.append(tr_make_trace(round_).trace_id)
    live.close()
    stored = _stored_ids(tmp_path)
    assert len(stored) == len(set(stored)), "duplicated traces after replay"
    missing = set(acked) - set(stored)
    assert not missing, f"{len(missing)} acknowledged traces lost, e.g. {sorted(missing)[:5]}"
    assert not list((tmp_path / "_wal" / "traces").iterdir())


def test_kill_9_in_interval_mode_loses_at_most_the_interval(tmp_path):
    interval, slack = 0.25, 0.5  # slack: the drain's own write+fsync and scheduling on a busy box
    acked, killed_at = _run_and_kill(tmp_path, "interval", interval, "i", 100, run_s=1.5)
    stored = set(_stored_ids(tmp_path))
    old_enough = [tid for tid, t in acked if t < killed_at - interval - slack]
    assert len(old_enough) > 100
    lost = [tid for tid in old_enough if tid not in stored]
    assert not lost, f"{len(lost)} traces older than the interval lost"


def test_interpreter_exit_without_close_flushes(tmp_path):
    code = (
        f"import sys; sys.path.insert(0, {str(CHILD.parent)!r}); from trace_child import make\n"
        "from rollout.traces import TraceConfig, TraceWriter\n"
        f"w = TraceWriter(TraceConfig(root={str(tmp_path)!r}, durability='interval', flush_interval_s=60))\n"
        "for k in range(7): w.append_nowait(make(f'x{k}', k))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert read_traces(tmp_path).num_rows == 7
    assert not list((tmp_path / "_wal" / "traces").iterdir())
