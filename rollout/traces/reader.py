"""Read the trace and feedback tables as Arrow, pruning partitions before opening files.

Only files the writer has renamed into place are visible (`part-*.parquet`); rows still in the
WAL are not (flush the writer first for a complete view). Row order is unspecified.
Other readers, for reference (the partition columns are in the files and the directory names):

    datasets.load_dataset("parquet", data_files=f"{root}/traces/**/*.parquet", split="train")
    duckdb.sql(f"select * from read_parquet('{root}/traces/**/*.parquet', hive_partitioning=true)")
    polars.scan_parquet(f"{root}/traces/**/*.parquet", hive_partitioning=True)
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import date, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from rollout.traces.schema import FEEDBACK_SCHEMA, TRACE_SCHEMA


def read_traces(
    root: str | Path,
    *,
    dates: Iterable[str | date] | None = None,
    weight_versions: Iterable[int] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """Traces under `<root>/traces`, only of the given UTC dates and weight versions, and created
    at `since` (tz-aware) or later and before `until`, if given."""
    expr = None
    if dates is not None:
        expr = _and(expr, ds.field("date").isin([_date_str(d) for d in dates]))
    if weight_versions is not None:
        expr = _and(expr, ds.field("weight_version").isin([int(v) for v in weight_versions]))
    if since is not None:
        if since.tzinfo is None:
            raise ValueError(f"since must be tz-aware, got {since!r}")
        expr = _and(expr, ds.field("created_at") >= pa.scalar(since, pa.timestamp("us", tz="UTC")))
    if until is not None:
        if until.tzinfo is None:
            raise ValueError(f"until must be tz-aware, got {until!r}")
        expr = _and(expr, ds.field("created_at") < pa.scalar(until, pa.timestamp("us", tz="UTC")))
    return _read(Path(root) / "traces", TRACE_SCHEMA, expr, columns)


def read_feedback(
    root: str | Path,
    *,
    dates: Iterable[str | date] | None = None,
    since: str | date | None = None,
    filter: ds.Expression | None = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """Feedback rows under `<root>/feedback`, only of the given UTC dates, or of `since` and
    later, and matching `filter` (a pyarrow expression, applied in the scan), if given."""
    expr = None if dates is None else ds.field("date").isin([_date_str(d) for d in dates])
    if since is not None:
        expr = _and(expr, ds.field("date") >= _date_str(since))
    if filter is not None:
        expr = _and(expr, filter)
    return _read(Path(root) / "feedback", FEEDBACK_SCHEMA, expr, columns)


def dataset(path: str | Path, schema: pa.Schema = TRACE_SCHEMA) -> ds.Dataset:
    """The pyarrow dataset of a table directory, with the hive partitioning typed by `schema`."""
    return ds.dataset(path, format="parquet", partitioning="hive", schema=schema)


def _read(path: Path, schema: pa.Schema, expr, columns: list[str] | None) -> pa.Table:
    if columns is not None:
        unknown = [c for c in columns if c not in schema.names]
        if unknown:
            raise ValueError(f"unknown columns {unknown}; known: {schema.names}")
    if not path.is_dir():
        empty = schema.empty_table()
        return empty if columns is None else empty.select(columns)
    return dataset(path, schema).to_table(columns=columns, filter=expr)


def _and(a, b):
    return b if a is None else a & b


def _date_str(d: str | date) -> str:
    if isinstance(d, date):
        return d.isoformat()
    date.fromisoformat(d)  # "YYYY-MM-DD" or ValueError
    return d
