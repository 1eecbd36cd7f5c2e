"""File hashing shared by every artifact that records what it holds (base model, quantized
checkpoints, datasets) and by the server's checks of a folder before a hot-swap."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in 1 MiB blocks (checkpoints can be larger than memory wants)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
