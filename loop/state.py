"""A `loop run`'s state on disk: <run_dir>/loop_state.json, rewritten atomically after every phase.

    state = LoopState.open(run_dir, cfg)   # the unfinished run there, or a new one
    state.cycle(k).done["train"]           # a finished phase's output (JSON), kept for the rerun

Killing `loop run` anywhere and running the same command again continues from the phase it was
in: finished phases are not run again (their outputs are read back from here), and what a killed
phase may have created outside the file (an MLflow run, a registry version) is found again by the
tag `loop_id` names, not created twice. A run whose cycles are all done is `finished`; the next
`loop run` on the same run_dir starts a new one (and serves what the registry says is serving).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "loop_state.json"
# keys a rerun may change without starting over (how many cycles), or that differ on every load
RESUMABLE_KEYS = ("loop.cycles", "collect.rollout.run_id")


@dataclass
class CycleState:
    k: int  # 1-based
    run_id: str | None = None  # its MLflow run (nested under the loop's)
    done: dict[str, dict] = field(default_factory=dict)  # phase -> its output, in the order run
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds (the try that finished)
    outcome: str | None = None  # "serving" | "rejected" | "rolled_back" | "swap_refused" | "no_signal" | "skipped"
    reason: str = ""
    # the promotion's intent (pipelines.promote.intent: from sha -> to sha, aliases as they were),
    # written before the swap; a rerun reconciles it with the server instead of guessing
    intent: dict | None = None

    @property
    def finished(self) -> bool:
        return self.outcome is not None


@dataclass
class LoopState:
    loop_id: str  # tags the parent MLflow run, the cycle runs and the registry versions
    config_sha256: str
    config: dict  # flattened, resolved: what a rerun is compared with
    run_id: str | None = None  # the parent MLflow run
    base: dict = field(default_factory=dict)  # {"path", "key", "eval"}: the bootstrap's base model
    serving: dict = field(default_factory=dict)  # {"path", "fp", "version"}: the policy served now
    learner: dict = field(default_factory=dict)  # {"fp", "serving_fp", "cycle", "delta"}: loop/learner.py
    cycles: list[CycleState] = field(default_factory=list)
    finished: bool = False
    path: str = ""

    @classmethod
    def open(cls, run_dir: Path, flat_config: dict) -> "LoopState":
        """The unfinished run in `run_dir` (its config must match but for RESUMABLE_KEYS), else a new one."""
        flat_config = json.loads(json.dumps(flat_config, default=str))  # as the file holds it: tuples are lists
        path = Path(run_dir) / STATE_FILE
        if path.is_file():
            old = _read(path)
            if not old.finished:
                changed = sorted(k for k in set(old.config) | set(flat_config)
                                 if k not in RESUMABLE_KEYS and old.config.get(k) != flat_config.get(k))
                if changed:
                    raise ValueError(
                        f"{path} holds an unfinished run with another config ({', '.join(changed[:8])} differ): "
                        f"run it with the same config to resume it, or delete {path} to start over")
                old.config = flat_config
                return old
            path.rename(path.with_name(f"loop_state-{old.loop_id}.json"))  # the finished run's, kept
        sha = hashlib.sha256(json.dumps(flat_config, sort_keys=True, default=str).encode()).hexdigest()
        state = cls(loop_id=uuid.uuid4().hex[:12], config_sha256=sha, config=flat_config, path=str(path))
        state.save()
        return state

    def cycle(self, k: int) -> CycleState:
        while len(self.cycles) < k:
            self.cycles.append(CycleState(len(self.cycles) + 1))
        return self.cycles[k - 1]

    def save(self) -> None:
        """Write-then-rename: a kill leaves the old file or the new one, never half of one."""
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({k: v for k, v in asdict(self).items() if k != "path"}, indent=1, default=str))
        os.replace(tmp, path)


def load(run_dir: str | Path) -> LoopState | None:
    """The newest state in `run_dir` (for `loop status`), or None."""
    path = Path(run_dir) / STATE_FILE
    return _read(path) if path.is_file() else None


def _read(path: Path) -> LoopState:
    d = json.loads(path.read_text())
    d["cycles"] = [CycleState(**c) for c in d["cycles"]]
    return LoopState(**{**d, "path": str(path)})
