"""The RL dataset's config, its Parquet schema and its manifest (the typed artifact it hands on).

A dataset directory holds `train/part-*.parquet`, `heldout/part-*.parquet` (episodes set aside
for the KL gate, never trained on) and `flywheel_manifest.json` (`RLDatasetManifest`), which appears last
and atomically: a directory without it is not a dataset.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Literal

import pyarrow as pa

from pipelines.rewards import DEFAULT_REWARD_FN, FEEDBACK_MODES, FeedbackMode, load_fn
from rollout.artifacts import MANIFEST
from rollout.traces.schema import LOGPROBS_MODES

DATASET_SCHEMA_VERSION = 2  # 2: per-token sampling temperatures

# One row per episode. List columns are per token, all of one length n = len(input_ids).
DATASET_SCHEMA = pa.schema([
    ("episode_id", pa.string()),
    ("group_id", pa.string()),  # GRPO group: same turn-0 prompt, weight version and round (traces_to_dataset.group_id)
    ("trace_ids", pa.list_(pa.string())),  # one per turn, in turn order
    ("num_turns", pa.int32()),
    ("prompt_len", pa.int32()),  # turn 0's prompt length: input_ids[:prompt_len] is the prompt
    ("input_ids", pa.list_(pa.int32())),  # (n,) last turn's prompt + completion
    ("assistant_mask", pa.list_(pa.int8())),  # (n,) 1 exactly on tokens the policy sampled
    ("behaviour_logprobs", pa.list_(pa.float32())),  # (n,) logged logprob where mask = 1, else 0
    ("weight_versions", pa.list_(pa.int64())),  # (n,) serving version where mask = 1, else -1
    # (n,) the temperature each sampled token was drawn at where mask = 1, else 1: the behaviour
    # logprobs are of softmax(logits / T), so the trainer scales its logits the same way
    ("temperatures", pa.list_(pa.float32())),
    ("reward", pa.float64()),
    ("weight_version", pa.int64()),  # the oldest version that sampled any of its tokens
    ("version_lag", pa.int64()),  # trainer base version - weight_version
    ("created_at", pa.timestamp("us", tz="UTC")),  # turn 0's arrival
    # an episode with a re-tokenized turn is split into rows of turns that extend each other
    # (pipelines/dataset/assemble.py `segments`): the row's index among its episode's, and how many;
    # then trace_ids, num_turns, prompt_len and input_ids are the segment's, reward the episode's
    ("segment", pa.int32()),
    ("segments", pa.int32()),
])


@dataclass
class DatasetConfig:
    trace_root: Path  # the server's data root: <trace_root>/traces, <trace_root>/feedback
    out_dir: Path  # the dataset directory to create (must not exist)
    tokenizer: str  # tokenizer folder (decodes episodes for the reward function)
    dates: tuple[str, ...] | None = None  # UTC "YYYY-MM-DD" partitions; None: all
    weight_versions: tuple[int, ...] | None = None  # None: all
    since: str | None = None  # ISO-8601 UTC time: only traces created then or later; None: all
    until: str | None = None  # ISO-8601 UTC time: only traces created before then; None: all
    heldout_fraction: float = 0.1
    heldout_unit: Literal["group", "episode"] = "group"  # what the held-out hash draws
    # at least this many held-out units (at most half of them): when the hash draws fewer, the
    # units it would take next are added (64 groups at 0.1 draw none 0.1% of the time, one 0.8%)
    min_heldout: int = 0
    seed: int = 0  # salts the held-out hash; same seed, same split on every rebuild
    reward_fn: str = DEFAULT_REWARD_FN  # "module:function", (EpisodeRecord) -> float | None
    # the task the episodes were played on (rollout.tasks.load_task): its tools read the episodes
    # back into messages, and `task_reward` scores them by its exact reward
    task: str = "calculator"
    feedback_mode: FeedbackMode = "override"
    rating_range: tuple[int, int] = (-1, 1)  # a rating-only feedback row's (lo, hi) (pipelines/rewards.py)
    logprobs_mode: str = "processed_logprobs"  # what the trainer expects (the server's); others are dropped
    trainer_base_version: int | None = None  # lag reference; None: the newest version read
    chunk_rows: int = 200_000  # trace rows assembled at a time (bounds memory)

    def __post_init__(self):
        self.trace_root, self.out_dir = Path(self.trace_root), Path(self.out_dir)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError("tokenizer must be a tokenizer folder path")
        if self.dates is not None:
            self.dates = tuple(self.dates)
            for d in self.dates:
                try:
                    date.fromisoformat(d)
                except (TypeError, ValueError):
                    raise ValueError(f"dates: {d!r} is not a 'YYYY-MM-DD' date") from None
        for name in ("since", "until"):
            if getattr(self, name) is not None:
                try:
                    if datetime.fromisoformat(getattr(self, name)).tzinfo is None:
                        raise ValueError
                except (TypeError, ValueError):
                    raise ValueError(f"{name}: {getattr(self, name)!r} is not an ISO-8601 time with a UTC offset") from None
        if self.weight_versions is not None:
            self.weight_versions = tuple(self.weight_versions)
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.weight_versions):
                raise ValueError(f"weight_versions must be ints >= 0, got {self.weight_versions}")
        if not (isinstance(self.heldout_fraction, (int, float)) and 0 <= self.heldout_fraction < 1):
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        if isinstance(self.min_heldout, bool) or not isinstance(self.min_heldout, int) or self.min_heldout < 0:
            raise ValueError(f"min_heldout must be an int >= 0, got {self.min_heldout!r}")
        if self.heldout_unit not in ("group", "episode"):
            raise ValueError(f"heldout_unit must be 'group' or 'episode', got {self.heldout_unit!r}")
        self.rating_range = tuple(self.rating_range)
        if (len(self.rating_range) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in self.rating_range)
                or not self.rating_range[0] < self.rating_range[1]):
            raise ValueError(f"rating_range must be two ints lo < hi, got {self.rating_range!r}")
        if self.feedback_mode not in FEEDBACK_MODES:
            raise ValueError(f"feedback_mode must be one of {FEEDBACK_MODES}, got {self.feedback_mode!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.trainer_base_version is not None and (
                isinstance(self.trainer_base_version, bool) or not isinstance(self.trainer_base_version, int)
                or self.trainer_base_version < 0):
            raise ValueError(f"trainer_base_version must be an int >= 0, got {self.trainer_base_version!r}")
        if not isinstance(self.chunk_rows, int) or self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be an int >= 1, got {self.chunk_rows!r}")
        try:
            load_fn(self.reward_fn)
        except (ImportError, ValueError) as e:
            raise ValueError(f"reward_fn {self.reward_fn!r}: {e}") from None
        from rollout.tasks import load_task

        load_task(self.task)


@dataclass(frozen=True)
class TraceWindow:
    """Which traces a dataset was built from (its parent)."""

    trace_root: str
    dates: tuple[str, ...] | None
    weight_versions: tuple[int, ...] | None
    since: str | None = None  # ISO-8601: traces created then or later
    until: str | None = None  # ISO-8601: and before then


@dataclass(frozen=True)
class RLDatasetManifest:
    path: str  # the dataset directory
    parent: TraceWindow
    rows_read: int  # trace rows in the window
    train_episodes: int
    heldout_episodes: int
    groups: int  # distinct group ids among kept episodes (train + heldout)
    dropped_rows: dict[str, int]  # row-level drops by reason (see pipelines/dataset/assemble.py)
    dropped_episodes: dict[str, int]  # episode-level drops by reason, incl. "missing_reward"
    weight_versions: tuple[int, ...]  # serving versions of kept episodes' tokens
    trainer_base_version: int
    reward_fn: str
    feedback_mode: str
    logprobs_mode: str
    heldout_fraction: float
    heldout_unit: str
    seed: int
    files: dict[str, str]  # path relative to `path` -> sha256
    created_at: str  # ISO 8601, UTC
    build_seconds: float
    schema_version: int = DATASET_SCHEMA_VERSION
    created_by: str = field(default="pipelines.traces_to_dataset")
    min_heldout: int = 0  # DatasetConfig.min_heldout (0 in manifests written before it)
    rating_range: tuple[int, int] = (-1, 1)
    task: str = "calculator"  # DatasetConfig.task
    split_episodes: int = 0  # episodes with a re-tokenized turn, kept as several rows (segments)
    segment_rows: int = 0  # the rows they became

    @property
    def kept_episodes(self) -> int:
        return self.train_episodes + self.heldout_episodes

    def files_of(self, split: Literal["train", "heldout"]) -> list[str]:
        return sorted(str(Path(self.path) / p) for p in self.files if p.startswith(split + "/"))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RLDatasetManifest":
        d = dict(d)
        if d.get("schema_version") != DATASET_SCHEMA_VERSION:
            raise ValueError(f"dataset schema_version {d.get('schema_version')} != {DATASET_SCHEMA_VERSION}")
        w = d["parent"]
        d["parent"] = TraceWindow(w["trace_root"], _tuple(w["dates"]), _tuple(w["weight_versions"]), w.get("since"),
                                  w.get("until"))
        d["weight_versions"] = tuple(d["weight_versions"])
        d["rating_range"] = tuple(d.get("rating_range", (-1, 1)))
        return cls(**d)


def _tuple(v):
    return None if v is None else tuple(v)


def save_manifest(m: RLDatasetManifest, directory: Path) -> Path:
    """Write `flywheel_manifest.json` into `directory` atomically (temporary file, fsync, rename)."""
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(m.to_dict(), f, indent=2, sort_keys=True, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_manifest(directory: str | Path) -> RLDatasetManifest:
    return RLDatasetManifest.from_dict(json.loads((Path(directory) / MANIFEST).read_text()))
