"""Atomic Parquet parts under hive directories: `<table_dir>/k1=v1/k2=v2/part-<uuid>.parquet`.

A part is written to a temporary file outside the table directory, fsynced, renamed into its
partition directory, and the directory is fsynced: a reader listing the table only ever sees
complete `part-*.parquet` files. Part names are uuid5s of a caller-given seed, the partition and
the chunk index, so writing the same rows with the same seed again replaces the same files
instead of adding copies (the replay of a WAL segment is idempotent).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_NAMESPACE = uuid.UUID("6f1d3c52-9a7e-4c1b-8d2f-0b5e7a9c4d11")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """`mkdir -p` that also makes each newly created entry durable in its parent."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        p.mkdir(exist_ok=True)
        fsync_dir(p.parent)


def write_parts(
    table: pa.Table,
    *,
    table_dir: Path,
    tmp_dir: Path,
    partition_cols: tuple[str, ...],
    seed: str,
    max_rows: int,
    compression: str = "zstd",
) -> list[Path]:
    """Split `table` by the partition columns (kept in the files too) and write each piece,
    in chunks of at most `max_rows` rows, as atomic parts. Row order is preserved."""
    if table.num_rows == 0:
        return []
    table = _as_hive_infers(table, partition_cols)
    keys = table.select(list(partition_cols)).group_by(list(partition_cols), use_threads=False).aggregate([])
    written = []
    for key in keys.to_pylist():
        mask = None
        for col in partition_cols:
            m = pc.equal(table[col], pa.scalar(key[col], table.schema.field(col).type))
            mask = m if mask is None else pc.and_(mask, m)
        piece = table.filter(mask)
        subdir = "/".join(f"{col}={_hive_value(key[col])}" for col in partition_cols)
        for i, start in enumerate(range(0, piece.num_rows, max_rows)):
            name = f"part-{uuid.uuid5(_NAMESPACE, f'{seed}/{subdir}/{i}')}.parquet"
            written.append(_write_atomic(piece.slice(start, max_rows), table_dir / subdir, tmp_dir, name, compression))
    return written


def _as_hive_infers(table: pa.Table, partition_cols: tuple[str, ...]) -> pa.Table:
    """Integer partition columns are stored in the files as int32, the type pyarrow's hive
    inference gives their directory values, so a plain `ds.dataset(root, partitioning="hive")`
    merges the two copies (int64 in the file made it fail). Readers given the schema
    (`read_traces`) cast back to its int64."""
    for col in partition_cols:
        i = table.schema.get_field_index(col)
        if pa.types.is_integer(table.schema.field(i).type) and table.schema.field(i).type != pa.int32():
            table = table.set_column(i, pa.field(col, pa.int32()), pc.cast(table[col], pa.int32()))  # checked: no overflow
    return table


def _hive_value(value) -> str:
    s = str(value)
    if not s or "/" in s or "=" in s:
        raise ValueError(f"partition value {value!r} cannot be a hive directory name")
    return s


def _write_atomic(table: pa.Table, dest_dir: Path, tmp_dir: Path, name: str, compression: str) -> Path:
    tmp = tmp_dir / f"{name}.tmp"
    with open(tmp, "wb") as f:
        pq.write_table(table, f, compression=compression)
        f.flush()
        os.fsync(f.fileno())
    make_dirs(dest_dir)
    dest = dest_dir / name
    os.replace(tmp, dest)
    fsync_dir(dest_dir)
    return dest
