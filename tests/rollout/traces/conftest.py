"""Fixtures for the trace store tests (prefixed `tr_`; the package dirs have no __init__.py)."""

from datetime import datetime, timedelta, timezone

import pytest

from rollout.traces import SamplingInfo, StackFingerprint, Trace

T0 = datetime(2026, 3, 1, 23, 59, 58, tzinfo=timezone.utc)


def make_trace(i: int, *, weight_version: int = 1, day: int = 0, **overrides) -> Trace:
    """A small but complete trace; `day` shifts created_at by whole days (another partition)."""
    stack = StackFingerprint(
        engine="vllm", engine_version="0.32.0", quant_format="compressed-tensors-w4a16",
        kv_cache_dtype="auto", device="cpu", device_name="test-cpu", torch_version="2.13.0",
        flywheel_version="0.1.0",
    )
    n = i % 5
    kwargs = dict(
        trace_id=f"t{i:06d}",
        request_id=f"req-{i}",
        episode_id=None if i % 3 == 0 else f"ep-{i // 4}",
        turn=None if i % 3 == 0 else i % 4,
        created_at=T0 + timedelta(days=day, microseconds=i),
        model="tiny-qwen2",
        weight_version=weight_version,
        checkpoint_sha256="ab" * 32,
        speculator_version=None if i % 2 else "spec-1",
        stack=stack,
        messages='[{"role": "user", "content": "hi %d"}]' % i,
        tools=None if i % 2 else '[{"type": "function", "function": {"name": "f"}}]',
        sampling=SamplingInfo(temperature=0.7, top_p=0.9, top_k=50, max_tokens=16, seed=i,
                              logprobs_mode="processed_logprobs"),
        prompt_token_ids=[i, 1, 2, 3, 4, 5][: 1 + i % 6],
        completion_token_ids=list(range(n)),
        completion_logprobs=[-0.5 * k for k in range(n)],
        output='{"content": "ok %d", "tool_calls": []}' % i,
        finish_reason="stop" if n else "length",
        ttft_ms=1.5 + i,
        e2e_ms=10.25 + i,
        num_cached_prompt_tokens=i % 3,
        spec_draft_tokens=i % 7,
        spec_accepted_tokens=i % 4,
    )
    kwargs.update(overrides)
    return Trace(**kwargs)


@pytest.fixture(scope="session")
def tr_make_trace():
    return make_trace
