"""The train phase's artifact: a Hugging Face folder (safetensors, config, tokenizer) holding the
latent full-precision weights, and `PolicyCheckpoint`, its manifest, written last and atomically
(the folder is built beside its destination and renamed)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollout.artifacts import MANIFEST

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class PolicyCheckpoint:
    path: str
    parent: str  # the checkpoint trained from (a Hugging Face folder)
    parent_sha256: str  # rollout.artifacts.checkpoint_sha256 of its weights
    dataset: str  # the RL dataset folder
    dataset_manifest_sha256: str  # sha256 of its manifest file (which holds every data file's hash)
    spec: dict | None  # the QuantSpec QAT trained through (kernels.QuantSpec.to_dict()); None: no QAT
    config: dict  # the RLConfig
    data: dict[str, int]  # episodes and groups trained on and left out, by reason
    metrics: dict[str, float]  # summary: steps, tokens, first/last loss, reward mean, tokens/s ...
    history: list[dict]  # per optimizer step metrics
    wall_seconds: float  # the whole job, load to save
    world_size: int
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    created_at: str = ""
    adv_estimator: str = ""  # the verl estimator the advantages came from (`auto` resolved on the data)
    adv_estimator_reason: str = ""
    nodes: list[str] = field(default_factory=list)  # where each rank ran (Ray node ids; "" outside Ray)
    kind: str = "policy_checkpoint"
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PolicyCheckpoint":
        if d.get("schema_version") != SCHEMA_VERSION or d.get("kind") != "policy_checkpoint":
            raise ValueError(f"not a policy checkpoint manifest (kind {d.get('kind')!r}, "
                             f"schema_version {d.get('schema_version')!r})")
        return cls(**d)


def save_manifest(m: PolicyCheckpoint, folder: Path) -> None:
    tmp = Path(folder) / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(m.to_dict(), f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(folder) / MANIFEST)


def load_checkpoint(folder: str | Path) -> PolicyCheckpoint:
    return PolicyCheckpoint.from_dict(json.loads((Path(folder) / MANIFEST).read_text()))
