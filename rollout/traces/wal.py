"""Write-ahead log segments: checksummed Arrow record batches in an append-only file.

A segment `seg-<ns>-<uuid>.wal` is a header (magic, schema version) followed by records
`[u32 length][u32 crc32][payload]`, each payload one Arrow IPC record-batch message without its
schema (the log's schema is implied by the schema version). A record counts only if it is
complete and its checksum matches; reading stops at the first one that is not (the torn tail
of a crash). A segment is written by one writer and never appended to once that writer moves
on or dies, so reading it again always yields the same rows: replay is deterministic.
Durability is the caller's: `sync()` (fdatasync) makes what was appended survive.
"""

from __future__ import annotations

import os
import struct
import time
import uuid
import zlib
from pathlib import Path

import pyarrow as pa

MAGIC = b"FWWAL001"
HEADER = struct.Struct("<8sH")
RECORD = struct.Struct("<II")
SUFFIX = ".wal"


def new_segment_path(wal_dir: Path) -> Path:
    return wal_dir / f"seg-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}{SUFFIX}"


def list_segments(wal_dir: Path) -> list[Path]:
    """Segments oldest first (names sort by creation time)."""
    return sorted(p for p in wal_dir.iterdir() if p.name.startswith("seg-") and p.name.endswith(SUFFIX))


class SegmentWriter:
    def __init__(self, path: Path, schema_version: int):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.bytes = 0
        self.rows = 0
        self._write(HEADER.pack(MAGIC, schema_version))

    def append(self, batch: pa.RecordBatch) -> int:
        """Append one record; returns the bytes written (not yet durable: call `sync`)."""
        payload = batch.serialize()
        before = self.bytes
        self._write(RECORD.pack(payload.size, zlib.crc32(payload)), payload)
        self.rows += batch.num_rows
        return self.bytes - before

    def sync(self) -> None:
        os.fdatasync(self._fd)  # data and the file size; the segment's name was synced at creation

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write(self, *chunks) -> None:
        views = [memoryview(c).cast("B") for c in chunks]
        total = sum(len(v) for v in views)
        written = os.writev(self._fd, views)
        while written < total:  # a short write: finish the rest chunk by chunk
            rest = b"".join(bytes(v) for v in views)[written:]
            written += os.write(self._fd, rest)
        self.bytes += total


def read_segment(path: Path, schema: pa.Schema, schema_version: int) -> pa.Table:
    """All complete, checksummed records of a segment, as one table (possibly empty)."""
    data = path.read_bytes()
    batches = []
    if len(data) >= HEADER.size:
        magic, version = HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise ValueError(f"{path}: not a Flywheel WAL segment")
        if version != schema_version:
            raise ValueError(f"{path}: WAL schema version {version}, this reader expects {schema_version}")
        pos = HEADER.size
        while pos + RECORD.size <= len(data):
            size, crc = RECORD.unpack_from(data, pos)
            start, end = pos + RECORD.size, pos + RECORD.size + size
            if end > len(data) or zlib.crc32(memoryview(data)[start:end]) != crc:
                break  # torn tail
            batches.append(pa.ipc.read_record_batch(pa.py_buffer(data[start:end]), schema))
            pos = end
    return pa.Table.from_batches(batches, schema=schema)
