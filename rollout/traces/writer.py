"""The trace writer of the rollout server: one `append` per served request, durable per config.

`await writer.append(trace)` costs the event loop a dict build and a queue push; the Arrow
conversion, the WAL write and the fsync run on the log's committer thread (log.py), which wakes
the waiting coroutines with one `call_soon_threadsafe` per group. In "commit" mode `append`
returns once the trace is fsynced to the WAL (concurrent appends share one fsync); in
"interval" mode it returns at once and a crash loses at most the last `flush_interval_s`.
Parquet parts appear under `<root>/traces/date=YYYY-MM-DD/weight_version=N/` when a WAL segment
rolls (`max_rows_per_file` rows or `max_file_age_s` seconds), on `flush()` and on `close()`;
the WAL left by a crash is replayed when the next writer starts. Several writers (e.g. one per
API server process) may share a root; each has its own WAL and adopts those of dead writers.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollout.traces.log import PartitionedLog, SyncWaiter
from rollout.traces.schema import SCHEMA_VERSION, TRACE_PARTITION_COLS, TRACE_SCHEMA, Trace

WRITE_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class TraceConfig:
    root: Path  # data root: traces go to <root>/traces, WALs to <root>/_wal/traces/<writer>
    durability: Literal["commit", "interval"] = "commit"
    flush_interval_s: float = 1.0  # "interval" mode: WAL fsync period, the most a crash loses
    max_rows_per_file: int = 10_000
    max_file_age_s: float = 60.0  # how long a trace may wait in the WAL before it is Parquet

    def __post_init__(self):
        self.root = Path(self.root)
        if self.durability not in ("commit", "interval"):
            raise ValueError(f"durability must be 'commit' or 'interval', got {self.durability!r}")
        if not self.flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be > 0, got {self.flush_interval_s}")
        if isinstance(self.max_rows_per_file, bool) or not isinstance(self.max_rows_per_file, int) or self.max_rows_per_file < 1:
            raise ValueError(f"max_rows_per_file must be an int >= 1, got {self.max_rows_per_file!r}")
        if not self.max_file_age_s > 0:
            raise ValueError(f"max_file_age_s must be > 0, got {self.max_file_age_s}")


@dataclass(frozen=True)
class WriterStats:
    traces_appended_total: int  # accepted by append
    traces_written_total: int  # durable in the WAL
    traces_failed_total: int  # rejected by the WAL (schema mismatch, I/O error)
    traces_replayed_total: int  # recovered from a previous writer's WAL at start
    parquet_rows_total: int
    parquet_parts_total: int
    conversion_errors_total: int
    wal_bytes: int  # WAL bytes not yet converted to Parquet
    wal_bytes_written_total: int
    wal_fsyncs_total: int  # one per group commit
    write_seconds_buckets: tuple[float, ...]  # upper bounds; counts has one more (+Inf)
    write_seconds_counts: tuple[int, ...]  # per bucket, not cumulative
    write_seconds_sum: float
    write_seconds_count: int


class TraceWriter:
    def __init__(self, cfg: TraceConfig):
        self.cfg = cfg
        self._log = PartitionedLog(
            cfg.root,
            "traces",
            schema=TRACE_SCHEMA,
            schema_version=SCHEMA_VERSION,
            partition_cols=TRACE_PARTITION_COLS,
            durability=cfg.durability,
            flush_interval_s=cfg.flush_interval_s,
            max_rows_per_file=cfg.max_rows_per_file,
            max_file_age_s=cfg.max_file_age_s,
        )
        self._hist_lock = threading.Lock()
        self._hist = [0] * (len(WRITE_SECONDS_BUCKETS) + 1)
        self._hist_sum = 0.0

    async def append(self, trace: Trace) -> None:
        """Record `trace`; returns once it is durable per `cfg.durability`. Raises ValueError if
        the trace does not fit the schema, OSError if the WAL cannot be written. If the awaiting
        task is cancelled the trace is still written."""
        t0 = time.perf_counter()
        row = trace.to_row()
        if self.cfg.durability == "interval":
            self._log.put(row, None)
        else:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._log.put(row, (loop, fut))
            await fut
        self._observe(time.perf_counter() - t0)

    def append_sync(self, trace: Trace) -> None:
        """`append` for threads without an event loop (blocks the caller, not a loop)."""
        t0 = time.perf_counter()
        row = trace.to_row()
        if self.cfg.durability == "interval":
            self._log.put(row, None)
        else:
            waiter = SyncWaiter()
            self._log.put(row, waiter)
            waiter.event.wait()
            if waiter.error is not None:
                raise waiter.error
        self._observe(time.perf_counter() - t0)

    def append_nowait(self, trace: Trace) -> None:
        """Queue `trace` without waiting for durability (e.g. from a task being cancelled);
        errors are logged and counted in `traces_failed_total`."""
        self._log.put(trace.to_row(), None)

    @property
    def writer_id(self) -> str:
        """This writer's id (its WAL directory's name), written in each of its rows."""
        return self._log.writer_id

    @property
    def failure(self) -> str | None:
        """Why traces are not being made durable now (None: they are)."""
        return self._log.failure

    def flush(self) -> None:
        """Block until every trace appended so far is in a Parquet part (from async code:
        `await asyncio.to_thread(writer.flush)`); RuntimeError when the writer has failed."""
        self._log.flush()

    def close(self) -> None:
        """Flush and stop; appends after this raise RuntimeError. Idempotent."""
        self._log.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> WriterStats:
        lg = self._log
        with self._hist_lock:
            counts, total = tuple(self._hist), self._hist_sum
        return WriterStats(
            traces_appended_total=lg.rows_put,
            traces_written_total=lg.rows_committed,
            traces_failed_total=lg.rows_failed,
            traces_replayed_total=lg.replayed_rows,
            parquet_rows_total=lg.parquet_rows,
            parquet_parts_total=lg.parquet_parts,
            conversion_errors_total=lg.conversion_errors,
            wal_bytes=lg.wal_bytes,
            wal_bytes_written_total=lg.wal_bytes_written,
            wal_fsyncs_total=lg.fsyncs,
            write_seconds_buckets=WRITE_SECONDS_BUCKETS,
            write_seconds_counts=counts,
            write_seconds_sum=total,
            write_seconds_count=sum(counts),
        )

    def _observe(self, seconds: float) -> None:
        i = bisect.bisect_left(WRITE_SECONDS_BUCKETS, seconds)
        with self._hist_lock:
            self._hist[i] += 1
            self._hist_sum += seconds


def register_metrics(registry, writer: TraceWriter) -> object:
    """Expose `writer.stats()` on a prometheus_client registry (read at scrape time)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class TraceCollector:
        def collect(self):
            s = writer.stats()
            for name, value, doc in (
                ("traces_appended", s.traces_appended_total, "Traces accepted by append."),
                ("traces_written", s.traces_written_total, "Traces durable in the write-ahead log."),
                ("traces_failed", s.traces_failed_total, "Traces the write-ahead log rejected."),
                ("traces_replayed", s.traces_replayed_total, "Traces recovered from the WAL at start."),
                ("trace_parquet_rows", s.parquet_rows_total, "Trace rows written to Parquet parts."),
                ("trace_wal_fsyncs", s.wal_fsyncs_total, "WAL fsyncs (one per group commit)."),
                ("trace_wal_bytes_written", s.wal_bytes_written_total, "Bytes written to the WAL."),
                ("trace_conversion_errors", s.conversion_errors_total, "WAL segments that failed to convert."),
            ):
                yield CounterMetricFamily(name, doc, value=value)
            yield GaugeMetricFamily("trace_wal_bytes", "WAL bytes not yet converted to Parquet.", value=s.wal_bytes)
            yield GaugeMetricFamily("trace_writer_up", "1 while traces are being made durable, 0 after a failure.",
                                    value=0 if writer.failure else 1)
            cumulative, buckets = 0, []
            for bound, count in zip((*s.write_seconds_buckets, float("inf")), s.write_seconds_counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            yield HistogramMetricFamily(
                "trace_write_seconds", "Latency of TraceWriter.append until durable per the mode.",
                buckets=buckets, sum_value=s.write_seconds_sum,
            )

    collector = TraceCollector()
    registry.register(collector)
    return collector
