"""The traffic a speculator learns from: recent ok requests of the serving version, as token
sequences (prompt + completion; the completion's tokens are the ones the target sampled, the only
positions a draft is ever asked to propose), split by a hash of the trace id."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from pipelines.logits import Sequences

COLUMNS = ["trace_id", "created_at", "status", "prompt_token_ids", "completion_token_ids"]


def traffic_sequences(root: str | Path, weight_versions: Iterable[int] | None = None, since: datetime | None = None,
                      max_requests: int = 4000, heldout_fraction: float = 0.1,
                      seed: int = 0) -> tuple[Sequences, Sequences]:
    """(train, held-out) requests of the trace window under `root`, the most recent `max_requests`."""
    from rollout.traces.reader import read_traces

    table = read_traces(root, weight_versions=weight_versions, since=since, columns=COLUMNS)
    rows = [r for r in table.to_pylist() if r["status"] == "ok" and r["completion_token_ids"]]
    if not rows:
        raise ValueError(f"no ok requests with completions under {root}/traces "
                         f"(weight versions {list(weight_versions) if weight_versions else 'all'}, since {since})")
    rows.sort(key=lambda r: (r["created_at"], r["trace_id"]), reverse=True)
    rows = rows[:max_requests]
    source = f"traces:{Path(root).resolve()}"
    split: dict[bool, list[dict]] = {False: [], True: []}
    for r in rows:
        h = int(hashlib.sha256(f"{seed}:{r['trace_id']}".encode()).hexdigest()[:8], 16) / 16 ** 8
        split[h < heldout_fraction].append(r)
    return _sequences(split[False], source + ":train"), _sequences(split[True], source + ":heldout")


def _sequences(rows: list[dict], source: str) -> Sequences:
    ids = tuple(tuple(r["prompt_token_ids"]) + tuple(r["completion_token_ids"]) for r in rows)
    sampled = tuple((0,) * len(r["prompt_token_ids"]) + (1,) * len(r["completion_token_ids"]) for r in rows)
    return Sequences(ids, sampled, source, tuple(r["trace_id"] for r in rows))
