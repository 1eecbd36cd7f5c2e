"""pyarrow, datasets, DuckDB and Polars read the same rows, partition columns included."""

import asyncio
from datetime import date, datetime, timezone

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from rollout.traces import TRACE_SCHEMA, Feedback, FeedbackStore, TraceConfig, TraceWriter, read_feedback, read_traces


@pytest.fixture(scope="module")
def tr_store(tmp_path_factory, tr_make_trace):
    root = tmp_path_factory.mktemp("traces")
    traces = [tr_make_trace(i, weight_version=[3, 12, 7][i % 3], day=i % 2) for i in range(24)]
    with TraceWriter(TraceConfig(root=root, max_rows_per_file=5)) as writer:
        for t in traces:
            writer.append_sync(t)
    expected = sorted((_canon(t.to_row()) for t in traces), key=lambda r: r["trace_id"])
    return root, expected


def _canon(row: dict) -> dict:
    """Every column, in one reader-independent form: DuckDB types `date` DATE, the rest agree."""
    out = {c: row[c] for c in TRACE_SCHEMA.names}
    if isinstance(out["date"], date):
        out["date"] = out["date"].isoformat()
    out["created_at"] = out["created_at"].astimezone(timezone.utc)  # naive would fail here
    return out


def _rows(rows) -> list[dict]:
    return sorted((_canon(r) for r in rows), key=lambda r: r["trace_id"])


def test_pyarrow_dataset_hive(tr_store):
    root, expected = tr_store
    table = ds.dataset(root / "traces", format="parquet", partitioning="hive", schema=TRACE_SCHEMA).to_table()
    assert _rows(table.to_pylist()) == expected


def test_pyarrow_plain_hive_read(tr_store, tmp_path):
    """What a data engineer types first, with no schema: the partition columns' two copies (file
    and directory) merge."""
    root, expected = tr_store
    table = ds.dataset(root / "traces", format="parquet", partitioning="hive").to_table()
    assert table.num_rows == len(expected) and table.schema.names.count("weight_version") == 1
    assert table.schema.field("date").type == pa.string() and table.schema.names.count("date") == 1
    by_id = {r["trace_id"]: (r["date"], r["weight_version"]) for r in table.to_pylist()}
    assert by_id == {r["trace_id"]: (r["date"], r["weight_version"]) for r in expected}
    with FeedbackStore(tmp_path) as store:
        store.append_sync(Feedback(trace_id="t1", reward=1.0, created_at=datetime(2026, 3, 2, 1, tzinfo=timezone.utc)))
    fb = ds.dataset(tmp_path / "feedback", format="parquet", partitioning="hive").to_table()
    assert fb.select(["trace_id", "date"]).to_pylist() == [{"trace_id": "t1", "date": "2026-03-02"}]


def test_parts_written_with_int64_partition_columns_still_read(tr_make_trace, tmp_path):
    """Parts from before the files stored weight_version as int32 sit beside newer ones:
    read_traces (its schema), DuckDB and Polars read both."""
    traces = [tr_make_trace(i, weight_version=4) for i in range(3)]
    with TraceWriter(TraceConfig(root=tmp_path)) as writer:
        for t in traces[:2]:
            writer.append_sync(t)
    old = pa.Table.from_pylist([traces[2].to_row()], schema=TRACE_SCHEMA)  # int64, as written before
    assert old.schema.field("weight_version").type == pa.int64()
    part = tmp_path / "traces" / f"date={old['date'][0]}" / "weight_version=4" / "part-old.parquet"
    pq.write_table(old, part)
    expected = _rows(t.to_row() for t in traces)
    table = read_traces(tmp_path)
    assert table.schema.field("weight_version").type == pa.int64() and _rows(table.to_pylist()) == expected
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    assert _rows(con.sql(f"select * from read_parquet('{tmp_path}/traces/**/*.parquet', hive_partitioning=true)")
                 .to_arrow_table().to_pylist()) == expected
    assert _rows(pl.scan_parquet(f"{tmp_path}/traces/**/*.parquet", hive_partitioning=True).collect().to_dicts()) == expected


def test_datasets_load_dataset(tr_store, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    root, expected = tr_store
    data = datasets.load_dataset("parquet", data_files=str(root / "traces/**/*.parquet"), split="train",
                                 cache_dir=str(tmp_path / "hf"))
    assert _rows(data) == expected


def test_duckdb_hive_partitioning(tr_store):
    root, expected = tr_store
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    table = con.sql(f"select * from read_parquet('{root}/traces/**/*.parquet', hive_partitioning=true)").to_arrow_table()
    assert table.schema.names.count("weight_version") == 1
    assert _rows(table.to_pylist()) == expected


def test_polars_hive_partitioning(tr_store):
    root, expected = tr_store
    frame = pl.scan_parquet(f"{root}/traces/**/*.parquet", hive_partitioning=True).collect()
    assert _rows(frame.to_dicts()) == expected


def test_read_traces_prunes_partitions_and_columns(tr_store):
    root, expected = tr_store
    assert _rows(read_traces(root).to_pylist()) == expected
    table = read_traces(root, dates=["2026-03-02"], weight_versions=[12, 7], columns=["trace_id", "weight_version"])
    want = {r["trace_id"] for r in expected if r["date"] == "2026-03-02" and r["weight_version"] in (12, 7)}
    assert table.column_names == ["trace_id", "weight_version"]
    assert set(table["trace_id"].to_pylist()) == want and len(want) == 8
    assert read_traces(root, dates=[date(2030, 1, 1)]).num_rows == 0
    # `since`: created then or later (a resumed collection reads its own traces, not a killed try's)
    times = sorted(r["created_at"] for r in expected)
    cut = times[len(times) // 2]
    later = read_traces(root, since=cut, columns=["trace_id"])["trace_id"].to_pylist()
    assert sorted(later) == sorted(r["trace_id"] for r in expected if r["created_at"] >= cut) and 0 < len(later) < len(times)
    with pytest.raises(ValueError, match="tz-aware"):
        read_traces(root, since=cut.replace(tzinfo=None))
    assert read_traces(root / "nowhere", columns=["trace_id"]).num_rows == 0
    with pytest.raises(ValueError, match="unknown columns"):
        read_traces(root, columns=["nope"])


def test_feedback_store_round_trip(tmp_path):
    with FeedbackStore(tmp_path) as store:
        store.append_sync(Feedback(trace_id="t1", reward=1.0, source="reward_fn:exact"))
    with FeedbackStore(tmp_path) as again:
        asyncio.run(again.append(Feedback(trace_id="t2", rating=-1, episode_id="e", comment="meh")))
    table = read_feedback(tmp_path)
    rows = sorted(table.to_pylist(), key=lambda r: r["trace_id"])
    assert [(r["trace_id"], r["reward"], r["rating"]) for r in rows] == [("t1", 1.0, None), ("t2", None, -1)]
    assert all(len(r["date"]) == 10 for r in rows)
    frame = pl.scan_parquet(f"{tmp_path}/feedback/**/*.parquet", hive_partitioning=True).collect()
    assert frame.height == 2
