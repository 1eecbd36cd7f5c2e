"""Tasks from the user's files: what `task.source` names, read into plain dicts per split.

    load_tasks("tasks/", "train")          # tasks/train.jsonl or tasks/train.parquet
    load_tasks("tasks.jsonl", "eval")      # one file whose rows carry "split": "train" | "eval"
    load_tasks("saved_dataset/", "train")  # a `datasets` DatasetDict saved with save_to_disk

Each task is a JSON object (a Parquet or `datasets` row); the agent receives it as a dict. A line
that is not a JSON object fails naming the file and the line; nothing is silently skipped.
"""

from __future__ import annotations

import json
from pathlib import Path


class TaskSourceError(ValueError):
    """The task source cannot be read; the message names the file (and line)."""


def _jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskSourceError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise TaskSourceError(f"{path}:{n}: a task is a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _parquet(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise TaskSourceError(f"{path}: not a readable Parquet file: {e}") from None


def _file(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return _jsonl(path)
    if path.suffix == ".parquet":
        return _parquet(path)
    raise TaskSourceError(f"{path}: tasks are .jsonl or .parquet files")


def load_tasks(source: str | Path, split: str) -> list[dict]:
    """The tasks of `split` in `source` (a folder of <split>.jsonl|parquet, a saved DatasetDict,
    or one file whose rows carry "split")."""
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            import datasets

            saved = datasets.load_from_disk(str(path))
            if split not in saved:
                raise TaskSourceError(f"{path}: the saved dataset has splits {sorted(saved)}, not {split!r}")
            return saved[split].to_list()
        found = [p for p in (path / f"{split}.jsonl", path / f"{split}.parquet") if p.is_file()]
        if not found:
            raise TaskSourceError(f"{path}: no {split}.jsonl or {split}.parquet")
        return _file(found[0])
    if not path.is_file():
        raise TaskSourceError(f"{path}: no such file or folder")
    rows = _file(path)
    if rows and not all("split" in r for r in rows):
        n = next(i for i, r in enumerate(rows, 1) if "split" not in r)
        raise TaskSourceError(f"{path}: row {n} has no \"split\" (one file holds every split, each row names its own)")
    return [r for r in rows if r["split"] == split]
