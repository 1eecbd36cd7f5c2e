"""vllm-router (PyPI `vllm-router`) in a child process: one per version group of a fleet
(rollout/server/fleet.py), with runtime add/remove of workers and a restart on the same port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rollout.server.process import _die_with_parent, free_port


class RouterProcess:
    """vllm-router over `worker_urls` in a child process (its own process group)."""

    def __init__(self, worker_urls: list[str], log_path: str | Path, policy: str = "consistent_hash",
                 host: str = "127.0.0.1", port: int | None = None, health_interval_s: int = 1,
                 startup_timeout_s: int = 600):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(self.port),
                    "--worker-urls", *worker_urls, "--policy", policy,
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--health-check-interval-secs", str(health_interval_s), "--health-failure-threshold", "2",
                    "--health-check-timeout-secs", "5", "--worker-startup-timeout-secs", str(startup_timeout_s),
                    "--request-timeout-secs", "600", "--log-level", "warning"]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> "RouterProcess":
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        return self

    def wait_ready(self, timeout: float = 120) -> "RouterProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode} (log {self.log_path})")
            try:
                if httpx.get(self.url + "/readiness", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm-router not ready after {timeout} s (log {self.log_path})")

    def restart(self) -> "RouterProcess":
        """Stopped and started again on its port with the workers it has now: consistent hashing
        on the same workers maps every session to the replica it had."""
        urls = self.workers()
        self.stop()
        i = self.cmd.index("--worker-urls")
        j = self.cmd.index("--policy")
        self.cmd[i + 1:j] = urls
        return self.start().wait_ready()

    def workers(self) -> list[str]:
        return httpx.get(self.url + "/list_workers", timeout=10).json()["urls"]

    def remove_worker(self, url: str) -> None:
        r = httpx.post(self.url + "/remove_worker", params={"url": url}, timeout=30)
        if r.status_code >= 400:
            raise RuntimeError(f"vllm-router remove_worker {url}: {r.status_code} {r.text}")

    def add_worker(self, url: str) -> None:
        r = httpx.post(self.url + "/add_worker", params={"url": url}, timeout=120)
        if r.status_code >= 400:
            raise RuntimeError(f"vllm-router add_worker {url}: {r.status_code} {r.text}")

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
