"""Feedback: rewards and user ratings that arrive after a trace, joined to it on `trace_id`.

An append-only table under `<root>/feedback/date=YYYY-MM-DD/part-*.parquet` (`date` is the UTC
date of the feedback's `created_at`, stored in the file too, as for traces). Traces are never
rewritten; a later reward for the same trace is a new row, and readers decide (e.g. latest
wins). Durability is the trace writer's machinery (log.py) in "commit" mode: `append` returns
once the feedback is fsynced to the WAL, so a 200 from `POST /v1/feedback` means it survives a
crash; it becomes Parquet when the segment rolls, on `flush()` and on `close()`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rollout.traces.log import PartitionedLog, SyncWaiter
from rollout.traces.reader import read_feedback
from rollout.traces.schema import (
    FEEDBACK_PARTITION_COLS,
    FEEDBACK_SCHEMA,
    FEEDBACK_SCHEMA_VERSION,
    new_id,
    utc_date,
    utc_now,
)

__all__ = ["ABANDONED", "Feedback", "FeedbackStore", "read_feedback"]

# The source of a row that withdraws an episode from training: its client gave up on it (timed
# out, retries exhausted), so a reward function must not score what it left behind.
ABANDONED = "abandoned"


@dataclass(kw_only=True)
class Feedback:
    """A reward (from a reward function or an environment) and/or a user rating of one trace."""

    trace_id: str
    reward: float | None = None
    rating: int | None = None  # e.g. -1/+1 thumbs or 1..5 stars; the scale is the source's
    episode_id: str | None = None
    comment: str | None = None
    source: str = "user"  # who gave it: "user", "env:<name>", "reward_fn:<name>", ...
    created_at: datetime = field(default_factory=utc_now)
    feedback_id: str = field(default_factory=new_id)

    def __post_init__(self):
        if not isinstance(self.trace_id, str) or not self.trace_id.strip():
            raise ValueError("feedback needs a non-empty trace_id")
        if self.reward is None and self.rating is None and self.source != ABANDONED:
            raise ValueError(f"feedback for trace {self.trace_id} needs a reward or a rating")
        if self.source == ABANDONED and (self.reward is not None or self.episode_id is None):
            raise ValueError(f"source {ABANDONED!r} withdraws an episode: it needs episode_id and no reward")
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
                raise ValueError(f"reward must be a finite number, got {self.reward!r}")
            self.reward = float(self.reward)
        if self.rating is not None and (isinstance(self.rating, bool) or not isinstance(self.rating, int)):
            raise ValueError(f"rating must be an int, got {self.rating!r}")
        if self.rating is not None and not -(2**31) <= self.rating < 2**31:
            raise ValueError(f"rating out of int32 range: {self.rating}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("feedback needs a non-empty source string")
        for name in ("episode_id", "comment"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        utc_date(self.created_at)  # rejects naive timestamps

    def to_row(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        row["created_at"] = self.created_at.astimezone(timezone.utc)
        row["date"] = utc_date(self.created_at)
        row["schema_version"] = FEEDBACK_SCHEMA_VERSION
        return row


class FeedbackStore:
    def __init__(self, root: str | Path, *, max_rows_per_file: int = 10_000, max_file_age_s: float = 60.0):
        if max_rows_per_file < 1 or not max_file_age_s > 0:
            raise ValueError("max_rows_per_file must be >= 1 and max_file_age_s > 0")
        self.root = Path(root)
        self._log = PartitionedLog(
            self.root,
            "feedback",
            schema=FEEDBACK_SCHEMA,
            schema_version=FEEDBACK_SCHEMA_VERSION,
            partition_cols=FEEDBACK_PARTITION_COLS,
            durability="commit",
            flush_interval_s=1.0,
            max_rows_per_file=max_rows_per_file,
            max_file_age_s=max_file_age_s,
        )

    async def append(self, feedback: Feedback) -> None:
        """Returns once `feedback` is fsynced to the WAL."""
        await self.append_many([feedback])

    async def append_many(self, feedbacks: list[Feedback]) -> None:
        """Returns once every one of `feedbacks` is fsynced to the WAL (one group commit for all)."""
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in feedbacks]
        for fb, fut in zip(feedbacks, futs):
            self._log.put(fb.to_row(), (loop, fut))
        await asyncio.gather(*futs)

    def append_sync(self, feedback: Feedback) -> None:
        waiter = SyncWaiter()
        self._log.put(feedback.to_row(), waiter)
        waiter.event.wait()
        if waiter.error is not None:
            raise waiter.error

    def flush(self) -> None:
        self._log.flush()

    def close(self) -> None:
        self._log.close()

    def __enter__(self) -> "FeedbackStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
