"""A group-committed write-ahead log that turns appended rows into atomic Parquet parts.

Callers `put` rows (dicts fitting `schema`) into an in-memory queue. One committer thread
drains the queue, writes each drained group as one WAL record, fsyncs once for the whole group
and then releases the callers waiting on it: concurrent appends share an fsync. One converter
thread turns sealed segments into Parquet parts and deletes each segment once all its parts
are in place. Neither thread holds the queue lock while doing I/O.

Durability. "commit": a row is fsynced to the WAL before its waiter is released (a caller whose
`put` was acknowledged never loses the row). "interval": the committer drains and fsyncs every
`flush_interval_s`, so a crash loses at most the rows put in the last interval.

Exactly once. A segment is sealed when it holds `max_rows_per_file` rows or its first row is
`max_file_age_s` old; it is never appended to again. Part names derive from the segment's name
(parts.py), the segment is deleted only after its parts are durable, and any segment left by a
dead writer is converted again (replay). A crash between the renames and the delete makes the
replay overwrite the same files with the same rows: no duplicates, no loss.

Several writers (processes) may share a root. Layout under `root`: `<name>/` the Parquet table;
`_wal/<name>/<writer id>/` each writer's segments and its LOCK, held with flock for the writer's
life (the kernel releases it when the process dies, kill -9 included); `_tmp/<name>/<writer
id>/` parts being written. A writer's directory appears (by rename) only once its LOCK is held.
At start a writer adopts every directory whose LOCK is free: it replays the segments, then
removes the directory.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa

from rollout.traces.owners import create_locked_dir, dead_writers, remove_tree
from rollout.traces.parts import fsync_dir, make_dirs, write_parts
from rollout.traces.wal import SegmentWriter, list_segments, new_segment_path, read_segment

log = logging.getLogger(__name__)

CONVERT_CHUNK_ROWS = 32  # rows per Arrow conversion (and WAL record): bounds one GIL hold


class SyncWaiter:
    __slots__ = ("event", "error")

    def __init__(self):
        self.event = threading.Event()
        self.error: BaseException | None = None


class _Barrier(SyncWaiter):
    """Queued like a row; released once everything put before it is in Parquet."""

    __slots__ = ("final",)

    def __init__(self, final: bool = False):
        super().__init__()
        self.final = final


def _resolve(pairs) -> None:
    for fut, err in pairs:
        if not fut.done():
            fut.set_result(None) if err is None else fut.set_exception(err)


class PartitionedLog:
    def __init__(
        self,
        root: Path,
        name: str,
        *,
        schema: pa.Schema,
        schema_version: int,
        partition_cols: tuple[str, ...],
        durability: str,
        flush_interval_s: float,
        max_rows_per_file: int,
        max_file_age_s: float,
    ):
        self.schema, self.schema_version, self.partition_cols = schema, schema_version, partition_cols
        self.durability, self.flush_interval_s = durability, flush_interval_s
        self.max_rows_per_file, self.max_file_age_s = max_rows_per_file, max_file_age_s
        self._row_type = pa.struct(list(schema))
        self.table_dir, self.wal_root, self.tmp_root = root / name, root / "_wal" / name, root / "_tmp" / name
        for d in (self.table_dir, self.wal_root, self.tmp_root):
            make_dirs(d)
        self.writer_id = writer_id = uuid.uuid4().hex[:16]
        self.wal_dir, self.tmp_dir = self.wal_root / writer_id, self.tmp_root / writer_id
        self._lock_fd = create_locked_dir(self.wal_dir)
        self.tmp_dir.mkdir()

        # counters, each written by one thread only
        self.rows_put = self.rows_committed = self.rows_failed = 0
        self.commit_groups = self.fsyncs = self.wal_bytes_written = 0
        self.wal_bytes_converted = self.parquet_rows = self.parquet_parts = self.conversion_errors = 0
        self.replayed_rows = 0
        self._adopt_dead_writers()

        self._cond = threading.Condition()
        self._pending: list[tuple[dict | None, Any]] = []
        self._barriers = 0
        self._closed = False
        self._inflight: list = []  # the group being committed (committer thread)
        self._dead: str | None = None  # the committer died (a bug): nothing is written any more
        self._io_error: str | None = None  # the last group commit failed; cleared by the next that succeeds
        self._segment: SegmentWriter | None = None
        self._segment_started = 0.0
        self._sealed: queue.Queue = queue.Queue()
        self._failed: list[Path] = []
        self._committer = threading.Thread(target=self._commit_loop, name=f"{name}-wal-commit", daemon=True)
        self._converter = threading.Thread(target=self._convert_loop, name=f"{name}-wal-convert", daemon=True)
        self._committer.start()
        self._converter.start()
        atexit.register(self.close)  # an interpreter exit without close() still flushes

    # ---- start: own directory, adoption of dead writers' WALs ---------------------------------
    def _adopt_dead_writers(self) -> None:
        for wal in dead_writers(self.wal_root, self.wal_dir):
            try:
                self._replay(wal)
            except FileNotFoundError:  # adopted and removed by another writer meanwhile
                pass

    def _replay(self, wal: Path) -> None:
        failed = 0
        for seg in list_segments(wal):
            try:
                rows, _ = self._convert(seg)
            except Exception:
                log.exception("replaying %s failed; it stays for the next writer to retry", seg)
                self.conversion_errors += 1
                failed += 1
                continue
            self.replayed_rows += rows
            log.info("replayed %s: %d rows", seg, rows)
        remove_tree(self.tmp_root / wal.name)  # its unfinished parts
        if not failed:
            remove_tree(wal)
            fsync_dir(self.wal_root)

    # ---- caller side -------------------------------------------------------------------
    def put(self, row: dict, waiter: Any) -> None:
        """Queue a row. `waiter`: None, a SyncWaiter, or (event loop, future); released once the
        row is durable per the durability mode, with the error if it could not be written."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.table_dir.name} writer is closed")
            self._pending.append((row, waiter))
            self.rows_put += 1
            n = len(self._pending)
            if self.durability == "commit" or n == 1 or n >= self.max_rows_per_file:
                self._cond.notify()  # interval mode: the first row starts the committer's clock

    @property
    def failure(self) -> str | None:
        """Why rows are not being made durable now (None: they are)."""
        return self._dead or self._io_error

    def flush(self, final: bool = False) -> None:
        """Block until every row put so far is in a Parquet part; RuntimeError if that cannot be."""
        barrier = _Barrier(final)
        with self._cond:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            if self._closed:
                return
            self._closed = final  # the final barrier is the last item ever queued
            self._pending.append((None, barrier))
            self._barriers += 1
            self._cond.notify()
        barrier.event.wait()
        if barrier.error is not None:
            raise barrier.error

    def close(self) -> None:
        if self._lock_fd < 0:
            return
        atexit.unregister(self.close)
        try:
            self.flush(final=True)
        finally:
            self._committer.join()
            self._converter.join()
            remove_tree(self.tmp_dir)
            if not self._failed:
                remove_tree(self.wal_dir)  # else left for the next writer to adopt
            os.close(self._lock_fd)
            self._lock_fd = -1

    @property
    def wal_bytes(self) -> int:
        return self.wal_bytes_written - self.wal_bytes_converted

    # ---- committer thread --------------------------------------------------------------
    def _commit_loop(self) -> None:
        try:
            self._commit_rows()
        except BaseException as e:  # a bug, not an I/O error: fail every waiter, accept no more
            log.exception("the WAL committer died")
            self._dead = f"the {self.table_dir.name} WAL committer died: {e!r}; rows are no longer written"
            with self._cond:
                self._closed = True
                items, self._pending = self._inflight + self._pending, []
            self._inflight = []
            self._release(items, [RuntimeError(f"the WAL committer died: {e!r}")] * len(items))
            self._sealed.put(_Barrier(final=True))

    def _commit_rows(self) -> None:
        last_drain = time.monotonic()
        while True:
            with self._cond:
                while (timeout := self._drain_wait(time.monotonic(), last_drain)) != 0:
                    self._cond.wait(timeout)
                items, self._pending, self._barriers = self._pending, [], 0
            last_drain = time.monotonic()
            group: list = []
            for row, waiter in items:
                if isinstance(waiter, _Barrier):
                    self._write_group(group)
                    group = []
                    self._seal()
                    self._sealed.put(waiter)
                    if waiter.final:
                        return
                else:
                    group.append((row, waiter))
            self._write_group(group)
            seg = self._segment
            if seg is not None and (seg.rows >= self.max_rows_per_file or self._segment_age() >= self.max_file_age_s):
                self._seal()

    def _drain_wait(self, now: float, last_drain: float) -> float | None:
        """0 to drain now, else how long to wait (None: until notified)."""
        wait = None
        if self._barriers:
            return 0
        if self._pending:
            if self.durability == "commit" or len(self._pending) >= self.max_rows_per_file:
                return 0
            wait = max(0.0, last_drain + self.flush_interval_s - now)
        if self._segment is not None:
            age_wait = max(0.0, self.max_file_age_s - self._segment_age())
            wait = age_wait if wait is None else min(wait, age_wait)
        return wait

    def _segment_age(self) -> float:
        return time.monotonic() - self._segment_started

    def _write_group(self, group: list) -> None:
        """One commit: the group's rows as WAL records, then one fsync."""
        if not group:
            return
        self._inflight = group  # released by _commit_loop if this commit dies
        errors: list[BaseException | None] = [None] * len(group)
        batches = []
        # Converting Python rows holds the GIL for the whole call: convert in small chunks so
        # the event loop thread never waits long for it.
        for start in range(0, len(group), CONVERT_CHUNK_ROWS):
            rows = [row for row, _ in group[start : start + CONVERT_CHUNK_ROWS]]
            try:
                batches.append(self._to_batch(rows))
            except Exception:  # find the rows that do not fit; write the others
                good = []
                for i, row in enumerate(rows, start):
                    try:
                        self._to_batch([row])
                        good.append(row)
                    except Exception as e:
                        errors[i] = ValueError(f"row does not fit the {self.table_dir.name} schema: {e}")
                if good:
                    batches.append(self._to_batch(good))
        if batches:
            try:
                if self._segment is None:
                    self._open_segment()
                for batch in batches:
                    self.wal_bytes_written += self._segment.append(batch)
                self._segment.sync()
                self.fsyncs += 1
                self.commit_groups += 1
                self.rows_committed += sum(b.num_rows for b in batches)
                self._io_error = None
            except OSError as e:
                log.exception("WAL write failed; a group of %d rows is reported failed", len(group))
                self._io_error = f"the {self.table_dir.name} WAL could not be written: {e}"
                errors = [err or e for err in errors]
                self._seal()  # its valid prefix is converted; the torn record is skipped
        self._inflight = []
        self._release(group, errors)

    def _to_batch(self, rows: list[dict]) -> pa.RecordBatch:
        # one struct conversion: about half the fixed cost of from_pylist's column by column
        return pa.RecordBatch.from_struct_array(pa.array(rows, type=self._row_type))

    def _release(self, group: list, errors: list) -> None:
        by_loop: dict = {}
        for (_, waiter), err in zip(group, errors):
            if err is not None:
                self.rows_failed += 1
            if waiter is None:
                if err is not None:
                    log.error("dropped a row: %s", err)
            elif isinstance(waiter, SyncWaiter):
                waiter.error = err
                waiter.event.set()
            else:
                loop, fut = waiter
                by_loop.setdefault(loop, []).append((fut, err))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, pairs)
            except RuntimeError:  # the caller's loop is closed; nobody is waiting
                pass

    def _open_segment(self) -> None:
        self._segment = SegmentWriter(new_segment_path(self.wal_dir), self.schema_version)
        fsync_dir(self.wal_dir)
        self.wal_bytes_written += self._segment.bytes
        self._segment_started = time.monotonic()

    def _seal(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._sealed.put(self._segment.path)
            self._segment = None

    # ---- converter thread --------------------------------------------------------------
    def _convert_loop(self) -> None:
        while True:
            item = self._sealed.get()
            if isinstance(item, _Barrier):
                self._failed = [p for p in self._failed if not self._try_convert(p)]
                if self._failed:
                    item.error = RuntimeError(
                        f"{len(self._failed)} WAL segments could not be converted (see the log); "
                        f"they stay in {self.wal_dir} and are replayed at the next start"
                    )
                item.event.set()
                if item.final:
                    return
            elif not self._try_convert(item):
                self._failed.append(item)

    def _try_convert(self, path: Path) -> bool:
        try:
            rows, size = self._convert(path)
        except Exception:
            log.exception("converting %s to Parquet failed", path)
            self.conversion_errors += 1
            return False
        self.wal_bytes_converted += size
        return True

    def _convert(self, path: Path) -> tuple[int, int]:
        table = read_segment(path, self.schema, self.schema_version)
        parts = write_parts(
            table,
            table_dir=self.table_dir,
            tmp_dir=self.tmp_dir,
            partition_cols=self.partition_cols,
            seed=path.name,
            max_rows=self.max_rows_per_file,
        )
        size = path.stat().st_size
        path.unlink()
        fsync_dir(path.parent)
        self.parquet_rows += table.num_rows
        self.parquet_parts += len(parts)
        return table.num_rows, size

