"""Helpers for the server tests: a real `loop serve` subprocess, checkpoints to swap in, SSE."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
ADMIN_TOKEN = "test-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """`python -m loop.cli serve conf/tiny.yaml ...` in a subprocess, on 127.0.0.1."""

    def __init__(self, model: str, trace_root: Path, log_path: Path, overrides: list[str] = (), env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.trace_root = Path(trace_root)
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "loop.cli", "serve", str(REPO / "conf" / "tiny.yaml"),
               f"serve.model={model}", f"serve.port={self.port}", f"serve.trace_root={self.trace_root}",
               f"serve.admin_token={ADMIN_TOKEN}", *overrides]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float = 240) -> "ServerProc":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                             timeout=kw.pop("timeout", 120), **kw)

    def flush(self) -> None:
        r = self.admin("POST", "/admin/flush")
        assert r.status_code == 200, r.text

    def traces(self) -> list[dict]:
        from rollout.traces import read_traces

        self.flush()
        return read_traces(self.trace_root).to_pylist()

    def trace(self, trace_id: str) -> dict:
        rows = [r for r in self.traces() if r["trace_id"] == trace_id]
        assert len(rows) == 1, f"{len(rows)} rows for trace {trace_id}"
        return rows[0]

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)  # the server's own process group (start_new_session)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def perturbed_copy(src: str | Path, dst: Path, scale: float = 0.05, seed: int = 1) -> Path:
    """A same-architecture, same-tokenizer checkpoint with different weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for p in Path(src).iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "flywheel_manifest.json":
            shutil.copy(p, dst / p.name)
    g = torch.Generator().manual_seed(seed)
    for shard in Path(src).glob("*.safetensors"):
        tensors = load_file(shard)
        out = {k: (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous()
               if v.is_floating_point() and v.ndim == 2 else v for k, v in tensors.items()}
        save_file(out, dst / shard.name, metadata={"format": "pt"})
    return dst


def chat_messages(text: str = "A box holds 12 pens. How many pens are in 7 boxes?") -> list[dict]:
    from rollout.task import SYSTEM_PROMPT

    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]


def sse_events(raw: str) -> list[dict]:
    return [json.loads(e[5:]) for e in raw.split("\n\n") if e.startswith("data:") and e[5:].strip() != "[DONE]"]
