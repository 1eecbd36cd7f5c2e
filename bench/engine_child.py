"""One engine per child process, for the benchmarks that compare engines: vLLM keeps process-wide
state (the kernels' environment switches, an in-process engine core), so each arm runs in a fresh
`python SCRIPT --worker JOB` that prints its result as one `RESULT {json}` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PREFIX = "RESULT "


def run_in_child(script: str, job: dict, name: str, env: dict | None = None) -> dict:
    """Run `script --worker JOB` with the engine core in-process and `env` on top of ours."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    proc = subprocess.run([sys.executable, script, "--worker", json.dumps(job)], capture_output=True, text=True,
                          env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(PREFIX):])


def print_result(result: dict) -> None:
    print(PREFIX + json.dumps(result), flush=True)
