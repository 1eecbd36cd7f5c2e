"""Who owns a WAL directory: a writer holds `LOCK` in its own directory with flock for its life.

The kernel releases the lock when the process dies (kill -9 included), so a directory whose lock
can be taken belongs to a dead writer: the next writer adopts it (replays its segments, then
removes it). A directory appears (by rename) only once its lock is held, so nobody adopts a
directory whose writer is still starting.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from rollout.traces.parts import fsync_dir


def create_locked_dir(final: Path) -> int:
    """Create `final` with its LOCK already held (staged under another name, then renamed);
    returns the lock's fd, to keep open for the writer's life."""
    staging = final.with_name(f".new-{final.name}")
    staging.mkdir()
    fd = os.open(staging / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else can know this directory yet
    os.rename(staging, final)
    fsync_dir(final.parent)
    return fd


def dead_writers(wal_root: Path, own: Path) -> Iterator[Path]:
    """Each writer directory under `wal_root` whose writer is dead, its LOCK held by this process
    while the caller handles it (released when the caller asks for the next)."""
    for wal in sorted(wal_root.iterdir()):
        if wal == own or not wal.is_dir() or wal.name.startswith(".new-"):
            continue  # (a staging directory holds no segment)
        try:
            fd = os.open(wal / "LOCK", os.O_RDWR)
        except FileNotFoundError:  # another writer is removing it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live writer
            os.close(fd)
            continue
        try:
            yield wal
        finally:
            os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a flat directory (files only) if it exists."""
    if not path.is_dir():
        return
    for p in path.iterdir():
        p.unlink(missing_ok=True)
    path.rmdir()
