"""Run as a script by test_cpu_placement.py: how long a sleeping reader of vLLM's shared-memory
queue waits for the second of two messages written ~0.3 ms apart (the worker's two answers per
step), with vLLM's notify socket ("vllm") or ours ("flywheel"). Prints the waits as JSON.

    python shm_wakeup.py vllm|flywheel [rounds]

The reader never busy-waits (spin 0: it sleeps at once, as our engine core does after 1 ms) and
rechecks the buffer without a notification after 1 s (vLLM: 5 s), so a lost notification shows
as a wait of ~1 s.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from vllm.distributed.device_communicators import shm_broadcast

from rollout.vllm_plugin import NOTIFY_HWM, patch_shm_queues


def waits(rounds: int) -> list[float]:
    writer = shm_broadcast.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=10)
    handle, box = writer.export_handle(), {}

    def connect() -> None:
        box["reader"] = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
        box["reader"].wait_until_ready()

    t = threading.Thread(target=connect)
    t.start()
    writer.wait_until_ready()
    t.join()
    out: list[float] = []

    def read() -> None:
        for _ in range(rounds):
            box["reader"].dequeue()
            t0 = time.perf_counter()
            box["reader"].dequeue()
            out.append(time.perf_counter() - t0)

    r = threading.Thread(target=read)
    r.start()
    for i in range(rounds):
        time.sleep(0.02)  # the reader falls asleep on the notify socket
        writer.enqueue(("execute_model", i))
        time.sleep(0.0003)
        writer.enqueue(("sample_tokens", i))
        while len(out) <= i and r.is_alive():  # nothing else is written until the reader has both
            time.sleep(0.001)
    r.join()
    return out


if __name__ == "__main__":
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = 1000
    patch_shm_queues(0.0, notify_hwm=1 if sys.argv[1] == "vllm" else NOTIFY_HWM)  # vLLM binds with 1
    print(json.dumps(waits(int(sys.argv[2]) if len(sys.argv) > 2 else 8)))
