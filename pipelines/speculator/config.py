"""The speculator stage's config and manifest (the loop's `speculator:` section)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollout.artifacts import MANIFEST, files_sha256


@dataclass
class DraftShape:
    """The draft's shape; vocabulary, tokenizer and everything else come from the target's config."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 1
    num_kv_heads: int = 1
    intermediate_size: int = 192

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculator.draft.{name} must be an int >= 1, got {v!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("speculator.draft: hidden_size must divide by num_heads, num_heads by num_kv_heads")


@dataclass
class SpeculatorConfig:
    enabled: bool = False  # a `speculator` phase in the loop (the server then runs method "draft")
    draft: DraftShape = field(default_factory=DraftShape)
    steps: int = 300  # optimizer steps per (re)training
    batch_size: int = 32  # requests per step
    lr: float = 3e-3
    warmup_steps: int = 20
    soft_weight: float = 1.0  # forward KL(target || draft) on the target's teacher-forced distributions
    hard_weight: float = 0.0  # cross-entropy on the served tokens (cheaper: no teacher forward needed)
    temperature: float = 1.0  # the serving temperature: acceptance is estimated, and soft targets taken, at it
    # draft tokens per step: bench/speculator.py at T=1, batch 1 on the AVX2 EPYC: k=2 1.34x and 1.35x plain
    # decode (two runs), k=3 1.27x (acceptance falls faster than the longer proposal pays)
    num_speculative_tokens: int = 2
    heldout_fraction: float = 0.1  # of requests (by a hash of the trace id): the offline acceptance slice
    max_requests: int = 4000  # the most recent ok requests of the window
    eval_positions: int = 2000  # draft starts scored offline (a hash-drawn sample of the held-out tokens)
    refresh_below: float = 0.7  # retrain when live acceptance < refresh_below x the offline estimate
    warm_start: bool = True  # from the previous draft, when its shape matches
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.draft, dict):
            self.draft = DraftShape(**self.draft)
        for name in ("steps", "batch_size", "num_speculative_tokens", "max_requests", "eval_positions"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculator.{name} must be an int >= 1, got {v!r}")
        if not 0 < self.lr < 1:
            raise ValueError(f"speculator.lr must be in (0, 1), got {self.lr!r}")
        if self.soft_weight < 0 or self.hard_weight < 0 or self.soft_weight + self.hard_weight == 0:
            raise ValueError("speculator.soft_weight and hard_weight must be >= 0, not both 0")
        if self.temperature < 0:
            raise ValueError(f"speculator.temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"speculator.heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")
        if not 0 < self.refresh_below <= 1:
            raise ValueError(f"speculator.refresh_below must be in (0, 1], got {self.refresh_below!r}")


@dataclass(frozen=True)
class Acceptance:
    """Expected speculative acceptance of a draft against its target (vLLM's greedy drafting and
    standard rejection sampling at `temperature`), per draft step of `k` tokens."""

    k: int
    temperature: float
    positions: int  # draft starts scored
    mean_accepted: float  # E[accepted draft tokens per step], in [0, k]

    @property
    def rate(self) -> float:  # vLLM's acceptance rate: accepted / drafted tokens
        return self.mean_accepted / self.k

    @property
    def length(self) -> float:  # vLLM's mean acceptance length: tokens emitted per target step
        return 1.0 + self.mean_accepted

    def to_dict(self) -> dict:
        return {**asdict(self), "rate": self.rate, "length": self.length}


@dataclass(frozen=True)
class SpeculatorManifest:
    path: str  # the draft: a Hugging Face folder with the target's tokenizer
    target: str  # the full-precision folder of the target version
    target_sha256: str
    target_version: int | None  # the serving weight version it was trained for
    parent: str | None  # the draft it was warm-started from
    traces: dict  # {"root", "weight_versions", "since", "requests", "train_tokens", "heldout_tokens"}
    offline: dict  # Acceptance.to_dict() of this draft on the held-out requests
    offline_before: dict  # the same for the draft it started from (untrained or the parent)
    config: dict
    num_parameters: int
    history: list[dict]
    seconds: float
    created_at: str

    def save(self, folder: str | Path) -> None:
        tmp = Path(folder) / (MANIFEST + ".tmp")
        files = files_sha256(folder)  # the swap loads a draft only with its files' hashes
        tmp.write_text(json.dumps({"kind": "speculator", **asdict(self), "files": files}, indent=2))
        tmp.replace(Path(folder) / MANIFEST)

    @classmethod
    def load(cls, folder: str | Path) -> "SpeculatorManifest":
        data = json.loads((Path(folder) / MANIFEST).read_text())
        data.pop("files", None)
        if data.pop("kind", None) != "speculator":
            raise ValueError(f"{folder} holds no speculator manifest")
        return cls(**data)
