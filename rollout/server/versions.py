"""Weight version numbers: one number names one checkpoint, forever.

    ledger = VersionLedger(trace_root / "weight_versions.jsonl", start=cfg.weight_version)
    v = ledger.allocate(sha, path, "swap")      # written (fsync) before any token carries it

Every number the server labels tokens with is taken from here, once: a swap that fails after its
version served traffic (a "keep" swap's canary) burns its number, and the next swap takes the one
after, so a trace's `weight_version` never names two checkpoints. The file is append-only JSON
lines (version, checkpoint sha256, path, event, time), kept beside the traces it numbers, so a
restarted server, or the loop choosing a start version, continues past every number ever used.

Replicas of a fleet share the trace root and so the ledger (appends under an flock). A fleet is one
policy: its replicas serving one checkpoint carry one number (`shared=True`, what a server with
`serve.replica` set uses). A replica that starts on, or drain-swaps to, a checkpoint the fleet
already numbered takes that number, also when it goes back to it (a canary rolled back: its
replicas serve the stable checkpoint under the stable number again, so an episode that moves
between replicas sees one number); a number a "keep" swap handed out is never taken again. A lone server's numbers only grow.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

LEDGER = "weight_versions.jsonl"
# events whose number a fleet's other replicas take for the same checkpoint: each numbers weights
# that passed their canary before any token carried it (a keep swap's may have served unchecked)
SHAREABLE = ("start", "swap", "swap (second engine)")


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
    def __init__(self, path: str | Path, start: int = 0, shared: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.start, self.shared = start, shared
        self._lock = threading.Lock()

    def allocate(self, sha: str, path: str, event: str, at_least: int = 0) -> int:
        """A number for (`sha`, `path`), recorded durably first: never handed out before (and
        >= `at_least`), or with `shared`, the fleet's number for `sha` when it has one."""
        with self._lock, open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the fleet's replicas append to one ledger
            entries = read_ledger(self.path)
            if self.shared and event in SHAREABLE:
                for e in reversed(entries):
                    if e["checkpoint_sha256"] == sha and e["event"] in SHAREABLE and e["version"] >= self.start:
                        return int(e["version"])
            v = max(self.start, at_least, max((int(e["version"]) for e in entries), default=-1) + 1)
            entry = {"version": v, "checkpoint_sha256": sha, "path": path, "event": event,
                     "at": datetime.now(timezone.utc).isoformat()}
            with open(self.path, "a") as f:
                torn = f.tell() > 0 and not self.path.read_bytes().endswith(b"\n")  # a kill mid-append
                f.write(("\n" if torn else "") + json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            return v
