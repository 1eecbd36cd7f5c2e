"""Overhead of the trace write path, measured side by side in one run, in both durability modes.

A simulated request handler awaits the engine (1-5 ms, asyncio.sleep), builds its Trace and
then either returns or `await writer.append(trace)`; the two variants run interleaved.

1. Open loop: requests arrive at a fixed rate (Poisson); request latency p50/p99 with/without
   append, and process CPU per request (the write path's cost in CPU, GIL included).
2. Closed loop: `clients` clients back to back, saturating the event loop: req/s with/without
   (the worst case: every microsecond of GIL the writer takes is a request not served).
3. Append alone: `clients` tasks appending back to back; p50/p99 of `append`, traces/s.
In commit mode a request waits for a group commit, so its added latency is about 1-2 fdatasyncs
of the disk, printed first for reference.
4. Optionally (--read-rows N): `read_traces` on N small rows.

    python bench/trace_writer.py [--rates 200,1000] [--clients 32] [--read-rows 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa

from rollout.traces import SamplingInfo, StackFingerprint, Trace, TraceConfig, TraceWriter, read_traces
from rollout.traces.parts import write_parts
from rollout.traces.schema import TRACE_PARTITION_COLS, TRACE_SCHEMA

STACK = StackFingerprint(engine="vllm", engine_version="0.32.0", quant_format="compressed-tensors-w4a16",
                         kv_cache_dtype="auto", device="cpu", device_name="bench", torch_version="2.13.0",
                         flywheel_version="0.1.0")
MESSAGES = json.dumps([{"role": "system", "content": "You are helpful. " * 40},
                       {"role": "user", "content": "Solve the task. " * 40}])


def make_trace(i: int, prompt_len: int = 512, completion_len: int = 128, weight_version: int = 1,
               created_at: datetime | None = None, messages: str = MESSAGES) -> Trace:
    return Trace(
        request_id=f"req-{i}", episode_id=f"ep-{i // 4}", turn=i % 4, model="tiny", weight_version=weight_version,
        checkpoint_sha256="ab" * 32, stack=STACK, sampling=SamplingInfo(temperature=1.0, max_tokens=completion_len),
        messages=messages, prompt_token_ids=list(range(i, i + prompt_len)),
        completion_token_ids=list(range(completion_len)), completion_logprobs=[-0.25] * completion_len,
        output=json.dumps({"content": "answer " * 30, "tool_calls": []}), finish_reason="stop",
        ttft_ms=12.0, e2e_ms=80.0, **({"created_at": created_at} if created_at else {}),
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def handle(writer: TraceWriter | None, i: int, work_s: float) -> float:
    t0 = time.perf_counter()
    await asyncio.sleep(work_s)  # the engine generating
    trace = make_trace(i)
    if writer is not None:
        await writer.append(trace)
    return time.perf_counter() - t0


async def open_loop(writer: TraceWriter | None, rate: float, seconds: float, seed: int) -> tuple[list, float]:
    """Latencies of Poisson arrivals at `rate`/s, and process CPU seconds per request."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    n = int(rate * seconds)
    cpu0, t_next, tasks = time.process_time(), loop.time(), []
    for i in range(n):
        t_next += rng.expovariate(rate)
        if (delay := t_next - loop.time()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(handle(writer, i, rng.uniform(0.001, 0.005))))
    latencies = await asyncio.gather(*tasks)
    return latencies, (time.process_time() - cpu0) / n


async def closed_loop(writer: TraceWriter | None, clients: int, requests: int, seed: int) -> float:
    """Requests per second of `clients` back-to-back clients."""
    rng = random.Random(seed)
    work = [rng.uniform(0.001, 0.005) for _ in range(requests)]
    queue = iter(range(requests))

    async def client():
        for i in queue:
            await handle(writer, i, work[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return requests / (time.perf_counter() - t0)


async def append_only(writer: TraceWriter, clients: int, requests: int) -> tuple[list, float]:
    traces = [make_trace(i) for i in range(requests)]
    latencies: list[float] = []
    queue = iter(traces)

    async def client():
        for trace in queue:
            t0 = time.perf_counter()
            await writer.append(trace)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, requests / (time.perf_counter() - t0)


def bench_mode(root: Path, durability: str, rates: list[float], clients: int, rounds: int = 3) -> None:
    cfg = TraceConfig(root=root / durability, durability=durability, flush_interval_s=0.1)
    print(f"[{durability}] handler: 1-5 ms engine wait, build a Trace (512+128 tokens), with/without append")
    with TraceWriter(cfg) as writer:
        for rate in rates:
            lat = {False: [], True: []}
            cpu = {False: [], True: []}
            for r in range(rounds):  # interleaved, so drift hits both sides alike
                for with_append in (False, True):
                    x, c = asyncio.run(open_loop(writer if with_append else None, rate, 1.5, seed=r))
                    lat[with_append] += x
                    cpu[with_append].append(c)
            b50, b99, w50, w99 = (pct(lat[w], q) for w in (False, True) for q in (.5, .99))
            bcpu, wcpu = statistics.median(cpu[False]), statistics.median(cpu[True])
            print(f"  open loop {rate:6.0f} req/s: p50 {b50 * 1e3:6.3f} -> {w50 * 1e3:6.3f} ms (x{w50 / b50:.3f})  "
                  f"p99 {b99 * 1e3:6.3f} -> {w99 * 1e3:6.3f} ms (x{w99 / b99:.3f})  "
                  f"CPU/request {bcpu * 1e6:5.0f} -> {wcpu * 1e6:5.0f} us (+{(wcpu - bcpu) * 1e6:.0f} us)")
        rps = {False: [], True: []}
        for r in range(rounds):
            for with_append in (False, True):
                rps[with_append].append(asyncio.run(closed_loop(writer if with_append else None, clients, 3000, r)))
        brps, wrps = statistics.median(rps[False]), statistics.median(rps[True])
        print(f"  closed loop, {clients} clients (saturated): {brps:6.0f} -> {wrps:6.0f} req/s (x{wrps / brps:.3f})")
        app_lat, app_tps = asyncio.run(append_only(writer, clients, 4000))
        print(f"  append alone, {clients} concurrent: p50 {pct(app_lat, .5) * 1e3:.3f} ms  "
              f"p99 {pct(app_lat, .99) * 1e3:.3f} ms  {app_tps:.0f} traces/s")
        writer.flush()
        stats = writer.stats()
    print(f"  {stats.traces_written_total} traces, {stats.wal_fsyncs_total} WAL fsyncs "
          f"({stats.traces_written_total / max(1, stats.wal_fsyncs_total):.1f} traces/fsync), "
          f"{stats.parquet_parts_total} parts, {stats.wal_bytes_written_total / 2**20:.1f} MiB WAL")


def disk_sync_latency(root: Path, n: int = 200) -> None:
    """The floor of commit mode's added latency: a 6 KB append + fdatasync on this disk, every
    5 ms like sparse traffic (back to back, some virtual disks answer much faster)."""
    lat = []
    with open(root / "sync-probe", "ab", buffering=0) as f:
        for _ in range(n):
            f.write(b"x" * 6000)
            t0 = time.perf_counter()
            os.fdatasync(f.fileno())
            lat.append(time.perf_counter() - t0)
            time.sleep(0.005)
    print(f"[disk] 6 KB append + fdatasync every 5 ms: p50 {pct(lat, .5) * 1e3:.3f} ms  p99 {pct(lat, .99) * 1e3:.3f} ms")


def bench_read(root: Path, rows: int) -> None:
    day = datetime(2026, 3, 1, tzinfo=timezone.utc)
    chunk = 50_000
    t0 = time.perf_counter()
    for start in range(0, rows, chunk):
        batch = [make_trace(i, 32, 16, weight_version=i % 4, created_at=day + timedelta(days=i * 4 // rows),
                            messages=f'[{{"role": "user", "content": "question {i}"}}]').to_row()
                 for i in range(start, min(rows, start + chunk))]
        write_parts(pa.Table.from_pylist(batch, schema=TRACE_SCHEMA), table_dir=root / "read" / "traces",
                    tmp_dir=root, partition_cols=TRACE_PARTITION_COLS, seed=str(start), max_rows=chunk)
    print(f"[read] wrote {rows} rows (32+16 tokens, 4 dates x 4 weight versions) in {time.perf_counter() - t0:.1f} s")
    for label, kwargs in (("all columns", {}), ("3 columns", {"columns": ["trace_id", "weight_version", "completion_logprobs"]}),
                          ("weight_version=2", {"weight_versions": [2]}),
                          ("1 date, 1 version", {"dates": ["2026-03-02"], "weight_versions": [2]})):
        t0 = time.perf_counter()
        n = read_traces(root / "read", **kwargs).num_rows
        dt = time.perf_counter() - t0
        print(f"  read_traces {label:18s} {n:8d} rows  {dt:6.3f} s  {n / dt / 1e6:5.2f} M rows/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="commit,interval", help="durability modes to measure ('' for none)")
    p.add_argument("--rates", default="200,1000", help="open-loop arrival rates, req/s")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--read-rows", type=int, default=0)
    p.add_argument("--root", type=Path, default=None, help="a directory on the disk to measure (default: a temp dir)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trace-bench-", dir=args.root))
    try:
        disk_sync_latency(root)
        for durability in filter(None, args.modes.split(",")):
            bench_mode(root, durability, [float(r) for r in args.rates.split(",")], args.clients)
        if args.read_rows:
            bench_read(root, args.read_rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
