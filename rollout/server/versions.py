"""Weight version numbers: one number names one checkpoint, forever.

    ledger = VersionLedger(trace_root / "weight_versions.jsonl", start=cfg.weight_version)
    v = ledger.allocate(sha, path, "swap")      # written (fsync) before any token carries it

Every number the server labels tokens with is taken from here, once: a swap that fails after its
version served traffic (a "keep" swap's canary) burns its number, and the next swap takes the one
after, so a trace's `weight_version` never names two checkpoints. The file is append-only JSON
lines (version, checkpoint sha256, path, event, time), kept beside the traces it numbers, so a
restarted server, or the loop choosing a start version, continues past every number ever used.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

LEDGER = "weight_versions.jsonl"


def read_ledger(path: str | Path) -> list[dict]:
    """The ledger's entries, oldest first ([] when there is none; a torn last line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a kill mid-append: that number was never handed out
            continue
    return out


def next_free(path: str | Path) -> int:
    """One past the highest number the ledger holds (0 when empty)."""
    return max((int(e["version"]) for e in read_ledger(path)), default=-1) + 1


class VersionLedger:
    def __init__(self, path: str | Path, start: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._next = max(start, next_free(self.path))

    def allocate(self, sha: str, path: str, event: str, at_least: int = 0) -> int:
        """A number never handed out before (and >= `at_least`), recorded durably for (`sha`, `path`) first."""
        with self._lock:
            v = max(self._next, at_least)
            entry = {"version": v, "checkpoint_sha256": sha, "path": path, "event": event,
                     "at": datetime.now(timezone.utc).isoformat()}
            with open(self.path, "a") as f:
                torn = f.tell() > 0 and not self.path.read_bytes().endswith(b"\n")  # a kill mid-append
                f.write(("\n" if torn else "") + json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._next = v + 1
            return v
