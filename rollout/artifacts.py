"""What every artifact folder is checked by: one manifest file name and one file hash.

A base model, a quantized checkpoint, an RL dataset and its verl export each hold
`flywheel_manifest.json` (their own typed manifest, with each file's sha256), written last and
atomically. A stage that derives a folder from another writes its own manifest and never copies
the parent's. The serving side checks a folder against it before a hot-swap; the loop and the
pipelines and the trainers write them. It lives at the bottom (rollout/, where the server checks
folders) and imports nothing of ours: the one module of rollout/ that trainers/ may import.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "flywheel_manifest.json"


@contextmanager
def building(folder: str | Path):
    """Held while one process builds a cached `folder` (a base model, a served quantization): a
    second process that wants the same folder waits here, then finds it built (check for the
    manifest again inside), instead of building it too and renaming over a folder in use."""
    lock = Path(folder).with_name(f".{Path(folder).name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in 1 MiB blocks (checkpoints can be larger than memory wants)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_sha256(folder: str | Path) -> str:
    """One hash for the weights: sha256 over the sorted (name, sha256) of the safetensors files."""
    files = sorted(Path(folder).glob("*.safetensors"))
    return hashlib.sha256("".join(f"{p.name}:{file_sha256(p)}\n" for p in files).encode()).hexdigest()


def folder_sha256(folder: str | Path) -> str:
    """One hash for everything a folder serves with (weights, config, tokenizer files), its
    manifest aside: what a cache keyed on a checkpoint must change with."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name != MANIFEST)
    rel = [p.relative_to(folder).as_posix() for p in files]
    return hashlib.sha256("".join(f"{r}:{file_sha256(p)}\n" for r, p in zip(rel, files)).encode()).hexdigest()


def files_sha256(folder: str | Path) -> dict[str, str]:
    """{relative path: sha256} of every file in `folder` but its manifest: what a manifest records."""
    root = Path(folder)
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def manifest_files(folder: str | Path) -> dict[str, str]:
    """{relative path: sha256} that the folder's manifest records ({} without a manifest): the
    base model's `files_sha256`, or the `files` of the other kinds."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return {}
    m = json.loads(path.read_text())
    return dict(m.get("files_sha256") or m.get("files") or {})
