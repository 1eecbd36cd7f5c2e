import asyncio
import os
import re
import shutil
import statistics
import threading
import time

import pyarrow.parquet as pq
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rollout.traces import Trace, TraceConfig, TraceWriter, read_traces, register_metrics

PART = re.compile(r"part-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.parquet")


def _by_id(table):
    return {r["trace_id"]: Trace.from_row(r) for r in table.to_pylist()}


def test_round_trip_async_and_sync(tmp_path, tr_make_trace):
    traces = [tr_make_trace(i, weight_version=i % 2, day=i % 3) for i in range(30)]
    with TraceWriter(TraceConfig(root=tmp_path)) as writer:

        async def main():
            await asyncio.gather(*(writer.append(t) for t in traces[:20]))

        asyncio.run(main())
        for t in traces[20:]:
            writer.append_sync(t)
        stats = writer.stats()
    assert stats.traces_written_total == 30 and stats.write_seconds_count == 30
    table = read_traces(tmp_path)
    assert table.num_rows == 30
    assert _by_id(table) == {t.trace_id: t for t in traces}
    dirs = {p.relative_to(tmp_path / "traces").parent.as_posix() for p in (tmp_path / "traces").rglob("*.parquet")}
    assert dirs == {f"date=2026-03-0{1 + d}/weight_version={w}" for d in range(3) for w in range(2)}
    assert not list((tmp_path / "_wal" / "traces").iterdir())


def test_only_complete_parts_are_ever_visible(tmp_path, tr_make_trace):
    seen, bad, stop = set(), [], threading.Event()

    def watch():
        while not stop.is_set():
            for p in (tmp_path / "traces").rglob("*"):
                if p.is_file() and p not in seen:
                    if not PART.fullmatch(p.name):
                        bad.append(p.name)
                    pq.read_metadata(p)  # complete: the footer is there
                    seen.add(p)

    cfg = TraceConfig(root=tmp_path, max_rows_per_file=40, max_file_age_s=0.05)
    with TraceWriter(cfg) as writer:
        watcher = threading.Thread(target=watch)
        watcher.start()

        async def main():
            async def client(c):
                for k in range(25):
                    await writer.append(tr_make_trace(c * 100 + k, weight_version=c % 3))
            await asyncio.gather(*(client(c) for c in range(16)))

        asyncio.run(main())
    stop.set()
    watcher.join()
    assert not bad
    assert len(seen) > 3  # parts rolled while the watcher looked
    assert all(pq.read_metadata(p).num_rows <= 40 for p in (tmp_path / "traces").rglob("*.parquet"))
    assert read_traces(tmp_path).num_rows == 400
    assert not list((tmp_path / "_tmp" / "traces").rglob("*"))


def test_replay_after_crash_between_rename_and_wal_delete(tmp_path, tr_make_trace):
    wal = tmp_path / "_wal" / "traces"
    traces = [tr_make_trace(i, weight_version=i % 2) for i in range(50)]
    writer = TraceWriter(TraceConfig(root=tmp_path, max_file_age_s=600))
    for t in traces:
        writer.append_sync(t)
    (dead,) = [p for p in wal.iterdir()]
    shutil.copytree(dead, tmp_path / "backup")
    writer.close()  # converts the segment into parts, then deletes it
    assert read_traces(tmp_path).num_rows == 50 and not list(wal.iterdir())
    shutil.copytree(tmp_path / "backup", dead)  # as if the writer died before the delete
    for seg in dead.glob("seg-*.wal"):
        with open(seg, "ab") as f:
            f.write(b"\x13\x00\x00\x00torn tail")
    with TraceWriter(TraceConfig(root=tmp_path)) as again:
        assert again.stats().traces_replayed_total == 50
    table = read_traces(tmp_path)
    assert sorted(table["trace_id"].to_pylist()) == sorted(t.trace_id for t in traces)
    assert not list(wal.iterdir()) and not list((tmp_path / "_tmp" / "traces").iterdir())


def test_writers_share_a_root_and_leave_each_other_alone(tmp_path, tr_make_trace):
    first = TraceWriter(TraceConfig(root=tmp_path, max_file_age_s=600))
    first.append_sync(tr_make_trace(1))
    with TraceWriter(TraceConfig(root=tmp_path)) as second:  # must not adopt the live first's WAL
        assert second.stats().traces_replayed_total == 0
        second.append_sync(tr_make_trace(2))
    assert read_traces(tmp_path)["trace_id"].to_pylist() == ["t000002"]
    first.append_sync(tr_make_trace(3))
    first.close()
    assert sorted(read_traces(tmp_path)["trace_id"].to_pylist()) == ["t000001", "t000002", "t000003"]


def test_concurrent_appends_share_fsyncs_and_keep_the_loop_free(tmp_path, tr_make_trace, monkeypatch):
    # What keeps the loop free is structural: the Arrow conversion, the WAL write and every fsync
    # run on the log's threads, never on the loop's. The threads doing them are recorded and checked;
    # the loop's tick lag is checked at its median (a blocking append would delay most ticks; one
    # stall of the whole process on a shared CI machine delays one, and is not the writer's doing).
    from rollout.traces.log import PartitionedLog

    workers: set[int] = set()  # threads that did the work while the clients ran (not at open or close)
    running = threading.Event()
    real_fsync, real_to_batch = os.fsync, PartitionedLog._to_batch

    def fsync(fd):
        if running.is_set():
            workers.add(threading.get_ident())
        return real_fsync(fd)

    def to_batch(self, rows):
        if running.is_set():
            workers.add(threading.get_ident())
        return real_to_batch(self, rows)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(PartitionedLog, "_to_batch", to_batch)
    n_clients, per_client = 64, 20
    with TraceWriter(TraceConfig(root=tmp_path, max_rows_per_file=300)) as writer:

        async def main():
            lags = []
            done = asyncio.Event()

            async def ticker():
                while not done.is_set():
                    t = time.perf_counter()
                    await asyncio.sleep(0.001)
                    lags.append(time.perf_counter() - t - 0.001)

            async def client(c):
                for k in range(per_client):
                    await writer.append(tr_make_trace(c * 1000 + k, weight_version=c % 4))

            tick = asyncio.create_task(ticker())
            running.set()
            await asyncio.gather(*(client(c) for c in range(n_clients)))
            running.clear()
            done.set()
            await tick
            return threading.get_ident(), lags

        loop_thread, lags = asyncio.run(main())
        stats = writer.stats()
    total = n_clients * per_client
    assert stats.traces_written_total == total
    assert stats.wal_fsyncs_total < total / 4  # group commit
    assert workers and loop_thread not in workers, "the loop's thread converted, wrote or fsynced"
    assert statistics.median(lags) < 0.05, f"median tick lag {statistics.median(lags):.3f}s (max {max(lags):.3f}s)"
    ids = read_traces(tmp_path, columns=["trace_id"])["trace_id"].to_pylist()
    assert len(ids) == len(set(ids)) == total


def test_a_row_that_does_not_fit_fails_only_its_own_append(tmp_path, tr_make_trace):
    bad = tr_make_trace(999, prompt_token_ids=[2**40])  # not an int32
    with TraceWriter(TraceConfig(root=tmp_path)) as writer:

        async def main():
            return await asyncio.gather(*(writer.append(t) for t in [tr_make_trace(1), bad, tr_make_trace(2)]),
                                        return_exceptions=True)

        results = asyncio.run(main())
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], ValueError) and "schema" in str(results[1])
        assert writer.stats().traces_failed_total == 1
    assert sorted(read_traces(tmp_path)["trace_id"].to_pylist()) == ["t000001", "t000002"]


def test_parts_roll_by_age_without_flush(tmp_path, tr_make_trace):
    with TraceWriter(TraceConfig(root=tmp_path, max_file_age_s=0.2)) as writer:
        for i in range(3):
            writer.append_sync(tr_make_trace(i))
        deadline = time.monotonic() + 5
        while read_traces(tmp_path).num_rows < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_traces(tmp_path).num_rows == 3
    with pytest.raises(RuntimeError, match="closed"):
        writer.append_sync(tr_make_trace(4))


def test_interval_mode_returns_at_once_and_syncs_within_the_interval(tmp_path, tr_make_trace, monkeypatch):
    # "At once" without a clock: every fsync is held until the appends have returned; an append
    # that waited for its fsync would still be waiting when the appends' thread is joined.
    release = threading.Event()
    real_fsync = os.fsync
    with TraceWriter(TraceConfig(root=tmp_path, durability="interval", flush_interval_s=0.2)) as writer:
        monkeypatch.setattr(os, "fsync", lambda fd: (release.wait(30), real_fsync(fd))[1])
        appends = threading.Thread(target=lambda: [writer.append_sync(tr_make_trace(i)) for i in range(100)])
        appends.start()
        appends.join(timeout=10)
        returned = not appends.is_alive()
        release.set()
        assert returned, "interval-mode appends waited for an fsync"
        deadline = time.monotonic() + 3
        while writer.stats().traces_written_total < 100 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer.stats().traces_written_total == 100
    assert read_traces(tmp_path).num_rows == 100


def test_metrics_on_a_prometheus_registry(tmp_path, tr_make_trace):
    registry = CollectorRegistry()
    with TraceWriter(TraceConfig(root=tmp_path)) as writer:
        register_metrics(registry, writer)
        writer.append_sync(tr_make_trace(1))
        text = generate_latest(registry).decode()
    assert "traces_written_total 1.0" in text
    assert 'trace_write_seconds_bucket{le="+Inf"} 1.0' in text
    assert "trace_wal_bytes " in text
