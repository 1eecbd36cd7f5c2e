"""The trace store: one Parquet row per served request, a WAL so none is lost, feedback beside it.

Server side: `TraceWriter(TraceConfig(root=...))`, `await writer.append(Trace(...))`,
`FeedbackStore(root)`. Dataset side: `read_traces(root, ...)`, `read_feedback(root)`.
"""

from rollout.traces.feedback import Feedback, FeedbackStore
from rollout.traces.reader import read_feedback, read_traces
from rollout.traces.schema import SCHEMA_VERSION, TRACE_SCHEMA, SamplingInfo, StackFingerprint, Trace
from rollout.traces.writer import TraceConfig, TraceWriter, WriterStats, register_metrics

__all__ = [
    "SCHEMA_VERSION",
    "TRACE_SCHEMA",
    "Feedback",
    "FeedbackStore",
    "SamplingInfo",
    "StackFingerprint",
    "Trace",
    "TraceConfig",
    "TraceWriter",
    "WriterStats",
    "read_feedback",
    "read_traces",
    "register_metrics",
]
