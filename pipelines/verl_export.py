"""An RL dataset -> verl's Parquet format, for verl's own trainer on a GPU cluster.

    export = export_verl(load_manifest(dataset_dir), VerlExportConfig(out_dir=..., tokenizer=...))

verl regenerates rollouts itself, so a row is a prompt, not an episode: one row per GRPO group
(same turn-0 prompt), with verl's columns
    data_source   str    `VerlExportConfig.data_source`
    prompt        list<struct<role, content>>  turn 0's messages, parsed from its exact tokens
    ability       str
    reward_model  struct<style, ground_truth>  ground truth from `ground_truth_fn` (None if unknown)
    extra_info    struct<index, split, group_id, episode_ids, trace_ids, rewards>
`train.parquet` holds the dataset's train split, `val.parquet` its held-out split (verl's
`data.train_files` / `data.val_files`). The tool list is not in `prompt` (verl's agent loop takes
tools from its tool config). Output appears atomically, with `flywheel_manifest.json` beside it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.dataset.manifest import RLDatasetManifest
from pipelines.rewards import EpisodeRecord, load_fn
from rollout.artifacts import MANIFEST, file_sha256
from rollout.chat import ChatFormat
from rollout.tasks import load_task

VERL_SCHEMA_VERSION = 1

VERL_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([
        ("index", pa.int64()),
        ("split", pa.string()),
        ("group_id", pa.string()),
        ("episode_ids", pa.list_(pa.string())),
        ("trace_ids", pa.list_(pa.string())),  # every turn of every episode of the group
        ("rewards", pa.list_(pa.float64())),  # the logged episodes' rewards, as the dataset holds them
    ])),
])
SPLIT_FILES = {"train": "train.parquet", "heldout": "val.parquet"}


@dataclass
class VerlExportConfig:
    out_dir: Path
    tokenizer: str  # decodes turn 0's prompt tokens into messages
    data_source: str | None = None  # verl's data_source column; None: "flywheel/<the dataset's task>"
    ability: str = "tool_use"
    ground_truth_fn: str = "pipelines.rewards:task_ground_truth"  # (EpisodeRecord) -> str | None

    def __post_init__(self):
        self.out_dir = Path(self.out_dir)
        for name in ("tokenizer", "data_source", "ability"):
            if name == "data_source" and self.data_source is None:
                continue
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        try:
            load_fn(self.ground_truth_fn)
        except (ImportError, ValueError) as e:
            raise ValueError(f"ground_truth_fn {self.ground_truth_fn!r}: {e}") from None


@dataclass(frozen=True)
class VerlExportManifest:
    path: str
    parent: str  # the RL dataset directory
    rows: dict[str, int]  # file name -> prompt rows
    files: dict[str, str]  # file name -> sha256
    data_source: str
    created_at: str
    schema_version: int = VERL_SCHEMA_VERSION

    @property
    def train_file(self) -> str:
        return str(Path(self.path) / SPLIT_FILES["train"])

    @property
    def val_file(self) -> str:
        return str(Path(self.path) / SPLIT_FILES["heldout"])


def export_verl(dataset: RLDatasetManifest, cfg: VerlExportConfig) -> VerlExportManifest:
    if cfg.out_dir.exists():
        raise FileExistsError(f"out_dir {cfg.out_dir} exists")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    decode = partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=False)
    task = load_task(dataset.task)
    chat = ChatFormat.of(tokenizer, task.tools)
    cfg = replace(cfg, data_source=cfg.data_source or f"flywheel/{task.name}")
    truth_fn = load_fn(cfg.ground_truth_fn)
    tmp = cfg.out_dir.with_name(f".{cfg.out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows, files = {}, {}
    for split, name in SPLIT_FILES.items():
        table = _split_rows(dataset, split, cfg, decode, chat, task, truth_fn)
        pq.write_table(table, tmp / name)
        rows[name], files[name] = table.num_rows, file_sha256(tmp / name)
    m = VerlExportManifest(path=str(cfg.out_dir), parent=dataset.path, rows=rows, files=files,
                           data_source=cfg.data_source, created_at=datetime.now(timezone.utc).isoformat())
    (tmp / MANIFEST).write_text(json.dumps(asdict(m), indent=2, sort_keys=True))
    os.rename(tmp, cfg.out_dir)
    return m


def _split_rows(dataset: RLDatasetManifest, split: str, cfg: VerlExportConfig, decode, chat, task, truth_fn
                ) -> pa.Table:
    """One verl row per group of the split, in order of the group's first episode."""
    paths = dataset.files_of(split)
    cols = ["episode_id", "group_id", "trace_ids", "prompt_len", "input_ids", "reward"]
    eps = pa.concat_tables([pq.read_table(p, columns=cols) for p in paths]).to_pylist() if paths else []
    groups: dict[str, list[dict]] = {}
    for ep in eps:
        groups.setdefault(ep["group_id"], []).append(ep)
    out = []
    for index, (gid, members) in enumerate(groups.items()):
        first = members[0]
        prompt_ids = first["input_ids"][:first["prompt_len"]]
        record = EpisodeRecord(first["episode_id"], tuple(first["trace_ids"]), first["input_ids"], decode, chat=chat, task=task)
        messages = EpisodeRecord(first["episode_id"], (), prompt_ids, decode, chat=chat).messages
        n = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:n]]  # not the open header
        truth = truth_fn(record)
        out.append({
            "data_source": cfg.data_source, "prompt": prompt, "ability": cfg.ability,
            "reward_model": {"style": "rule", "ground_truth": None if truth is None else str(truth)},
            "extra_info": {"index": index, "split": split, "group_id": gid,
                           "episode_ids": [m["episode_id"] for m in members],
                           "trace_ids": [t for m in members for t in m["trace_ids"]],
                           "rewards": [m["reward"] for m in members]},
        })
    return pa.Table.from_pylist(out, schema=VERL_SCHEMA)

