"""`loop serve` in a child process: what the loop, the benchmarks and the tests start and stop.

    with ServerProcess("conf/agent_rl.yaml", model=path, trace_root=root, log_path=log) as srv:
        httpx.get(srv.url + "/health")
        srv.flush()                       # the traces so far are on disk

The server runs in its own process group (vLLM's engine core and workers with it), on 127.0.0.1
and a free port, with an admin token of its own passed by environment (not on the command line).
It gets SIGTERM when the process that started it dies, however that dies.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOKEN_ENV = "FLYWHEEL_ADMIN_TOKEN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG), so a killed `loop run` leaves no server behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux/glibc: the loop's resume stops a server it finds left over
        pass


class AdminClient:
    """A server's admin API (`url`, `admin_token`): what a fleet asks of each replica."""

    url: str
    admin_token: str

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"authorization": f"Bearer {self.admin_token}"},
                             timeout=kw.pop("timeout", 120), **kw)

    def flush(self) -> None:
        """Every trace and feedback row accepted so far is in a committed Parquet file."""
        r = self.admin("POST", "/admin/flush")
        if r.status_code != 200:
            raise RuntimeError(f"POST /admin/flush: {r.status_code} {r.text}")


class ServerProcess(AdminClient):
    def __init__(self, config: str | Path, model: str | Path, trace_root: str | Path, log_path: str | Path,
                 overrides: list[str] = (), env: dict | None = None, admin_token: str | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.trace_root, self.log_path = Path(trace_root), Path(log_path)
        self.admin_token = admin_token or secrets.token_hex(16)
        cmd = [sys.executable, "-m", "loop.cli", "serve", str(config), f"serve.model={model}",
               "serve.host=127.0.0.1", f"serve.port={self.port}", f"serve.trace_root={self.trace_root}",
               "serve.admin_token=null", f"serve.admin_token_env={TOKEN_ENV}", *overrides]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    **(env or {}), TOKEN_ENV: self.admin_token}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True, preexec_fn=_die_with_parent)

    def __enter__(self) -> "ServerProcess":
        try:
            return self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout: float = 300) -> "ServerProcess":
        """Until /health answers 200, or 503 "held:" (a fleet replica up and waiting for its release)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} (log {self.log_path}):\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 or (r.status_code == 503 and "held:" in r.text):  # up, or up and held
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s (log {self.log_path}):\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)  # the server's own process group (start_new_session)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
