from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from rollout.traces import SCHEMA_VERSION, TRACE_SCHEMA, Feedback, SamplingInfo, Trace, TraceConfig


def test_schema_follows_architecture_table():
    assert SCHEMA_VERSION == 1
    types = {f.name: f.type for f in TRACE_SCHEMA}
    assert types["turn"] == pa.int32() and types["weight_version"] == pa.int64()
    assert types["created_at"] == pa.timestamp("us", tz="UTC")
    assert types["prompt_token_ids"] == pa.list_(pa.int32())
    assert types["completion_logprobs"] == pa.list_(pa.float32())
    assert types["schema_version"] == pa.int16() and types["date"] == pa.string()
    assert "logprobs_mode" in types["sampling"].names
    for name in ("status", "error", "finish_reason", "num_cached_prompt_tokens", "spec_accepted_tokens"):
        assert name in types


def test_row_fits_schema_and_round_trips(tr_make_trace):
    trace = tr_make_trace(7)
    row = trace.to_row()
    assert set(row) == set(TRACE_SCHEMA.names)
    back = pa.Table.from_pylist([row], schema=TRACE_SCHEMA).to_pylist()[0]
    assert Trace.from_row(back) == trace


def test_date_partition_is_the_utc_date(tr_make_trace):
    local = timezone(timedelta(hours=-5))
    trace = tr_make_trace(1, created_at=datetime(2026, 3, 1, 21, 30, tzinfo=local))
    assert trace.to_row()["date"] == "2026-03-02"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(status="done"), "status"),
        (dict(status="error", error=None), "error"),
        (dict(completion_logprobs=[-1.0]), "completion_logprobs"),
        (dict(created_at=datetime(2026, 1, 1)), "timezone-aware"),
        (dict(weight_version=-1), "weight_version"),
        (dict(request_id=""), "request_id"),
    ],
)
def test_invalid_trace_rejected(tr_make_trace, overrides, field):
    with pytest.raises(ValueError, match=field):
        tr_make_trace(3, **overrides)


def test_failed_request_may_log_no_logprobs(tr_make_trace):
    trace = tr_make_trace(4, status="aborted", completion_logprobs=[], finish_reason="abort")
    assert trace.to_row()["status"] == "aborted"
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingInfo(temperature=1.0, logprobs_mode="logits")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(durability="sometimes"), "durability"),
        (dict(flush_interval_s=0), "flush_interval_s"),
        (dict(max_rows_per_file=0), "max_rows_per_file"),
        (dict(max_file_age_s=-1), "max_file_age_s"),
    ],
)
def test_config_validates_itself(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        TraceConfig(root=tmp_path, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(trace_id="t1"), "reward or a rating"),
        (dict(trace_id="", reward=1.0), "trace_id"),
        (dict(trace_id="t1", reward=float("nan")), "finite"),
        (dict(trace_id="t1", rating=4.5), "rating must be an int"),
        (dict(trace_id="t1", rating=True), "rating must be an int"),
        (dict(trace_id="t1", reward=1.0, source=""), "source"),
        (dict(trace_id="t1", reward=1.0, source=None), "source"),
        (dict(trace_id="t1", reward=1.0, comment=5), "comment"),
        (dict(trace_id=7, reward=1.0), "trace_id"),
        (dict(trace_id="t1", reward="1.0"), "finite number"),
    ],
)
def test_bad_feedback_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Feedback(**kwargs)
