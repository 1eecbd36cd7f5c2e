"""Crash-test child: appends traces from 8 concurrent tasks until killed, printing
"<trace_id> <monotonic time>" for each trace once its `append` has returned.

    python trace_child.py ROOT DURABILITY FLUSH_INTERVAL_S TAG
"""

import asyncio
import sys
import time

from rollout.traces import SamplingInfo, StackFingerprint, Trace, TraceConfig, TraceWriter

STACK = StackFingerprint(engine="vllm", engine_version="0.32.0", quant_format="none", kv_cache_dtype="auto",
                         device="cpu", device_name="test-cpu", torch_version="2.13.0", flywheel_version="0.1.0")


def make(trace_id: str, k: int) -> Trace:
    return Trace(trace_id=trace_id, request_id=trace_id, model="tiny", weight_version=k % 3, checkpoint_sha256="00",
                 stack=STACK, sampling=SamplingInfo(temperature=1.0), messages="[]",
                 prompt_token_ids=list(range(64)), completion_token_ids=[1, 2, 3, 4],
                 completion_logprobs=[-0.1, -0.2, -0.3, -0.4], output="{}", finish_reason="stop", e2e_ms=1.0)


async def main(root: str, durability: str, interval: float, tag: str) -> None:
    # commit mode: small parts and a short age, so that conversions are in flight at the kill;
    # interval mode: nothing but the interval makes the committer sync
    commit = durability == "commit"
    cfg = TraceConfig(root=root, durability=durability, flush_interval_s=interval,
                      max_rows_per_file=40 if commit else 100_000, max_file_age_s=0.05 if commit else 60)
    writer = TraceWriter(cfg)

    async def client(c: int) -> None:
        k = 0
        while True:
            trace = make(f"{tag}-{c}-{k}", k)
            await writer.append(trace)
            sys.stdout.write(f"{trace.trace_id} {time.monotonic()}\n")
            sys.stdout.flush()
            k += 1
            if durability == "interval":
                await asyncio.sleep(0.002)

    await asyncio.gather(*(client(c) for c in range(8)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))
