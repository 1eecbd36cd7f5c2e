"""Failpoints: a named place where a test kills the process, to prove a side effect outside it
(a swap, an alias move) is reconciled on the rerun (etcd's gofail, FoundationDB's buggify).

    failpoint("promote:after_swap")   # SIGKILL here when $FLYWHEEL_FAILPOINTS names it

Off unless the environment names the point; costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "FLYWHEEL_FAILPOINTS"


def failpoint(name: str) -> None:
    if name in os.environ.get(ENV, "").split(","):
        print(f"[failpoint] {name}: SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
