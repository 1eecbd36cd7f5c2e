"""N `loop serve` replicas behind vllm-router, on one machine: what `loop serve --replicas N`, the
benchmarks and the tests start.

    with Fleet("conf/agent_rl.yaml", model=path, trace_root=root, log_dir=logs, replicas=2) as fleet:
        httpx.post(fleet.url + "/v1/completions", headers={"X-Session-ID": episode_id}, json=...)
        fleet.flush()                      # every replica's traces so far are on disk

Why vllm-router, and why `consistent_hash` (../shared/notes/apis-wave3.md §3): it is the router the
vLLM project ships (a Rust core on PyPI, health checks, retries, runtime `add_worker`/`remove_worker`),
and its consistent_hash policy keys on the `X-Session-ID` header, which the collector and the
Agents SDK client set to the episode id: every turn of an episode reaches the replica that holds
its prefix in cache, and a replica that leaves the ring moves only its own episodes. Its
cache_aware default matches request text and would split an episode whose turns' texts diverge.
It has no weighted split, so a canary is a subset of replicas (a version per replica), not a
percentage of one replica's traffic.

Every replica writes into the one trace root (its own WAL and writer id; `replica` in each row),
so the dataset build reads the fleet's traces as one table. On a CPU machine each replica's vLLM
worker gets its own slice of the cores (`VLLM_CPU_OMP_THREADS_BIND`): two replicas on 2 cores
get one core each, and their front ends share the rest.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rollout.server.process import ServerProcess, _die_with_parent, free_port


def core_slices(n: int, cores: list[int] | None = None) -> list[str | None]:
    """`VLLM_CPU_OMP_THREADS_BIND` for each of `n` replicas: contiguous, disjoint slices of this
    process's cores ("0" and "1" on 2 cores; "0,1,2,3" and "4,5,6,7" on 8); None each when there are fewer
    cores than replicas, or one replica (vLLM binds as it would alone)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if n < 2 or len(cores) < n:
        return [None] * max(n, 0)
    per = len(cores) // n
    return [",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(n)]


class RouterProcess:
    """vllm-router over `worker_urls` in a child process (its own process group)."""

    def __init__(self, worker_urls: list[str], log_path: str | Path, policy: str = "consistent_hash",
                 host: str = "127.0.0.1", port: int | None = None, health_interval_s: int = 1,
                 startup_timeout_s: int = 600):
        self.port = port or free_port()
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
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


class Fleet:
    """`replicas` servers of `model` sharing `trace_root` (and one admin token), behind a router."""

    def __init__(self, config: str | Path, model: str | Path, trace_root: str | Path, log_dir: str | Path,
                 replicas: int = 2, overrides: list[str] = (), env: dict | None = None, admin_token: str | None = None,
                 policy: str = "consistent_hash", router_host: str = "127.0.0.1", router_port: int | None = None):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.log_dir, self.policy, self.router_host, self.router_port = Path(log_dir), policy, router_host, router_port
        self.admin_token = admin_token or secrets.token_hex(16)
        self._start = dict(config=config, model=model, trace_root=trace_root, overrides=list(overrides), env=env or {})
        self.binds = core_slices(replicas)
        self.servers = [self._server(i) for i in range(replicas)]  # all start at once; ~30 s each here
        self.router: RouterProcess | None = None

    def _server(self, i: int, port: int | None = None) -> ServerProcess:
        a = self._start
        env = {**a["env"], **({"VLLM_CPU_OMP_THREADS_BIND": self.binds[i]} if self.binds[i] else {})}
        return ServerProcess(a["config"], a["model"], a["trace_root"], self.log_dir / f"replica-{i}.log",
                             overrides=[*a["overrides"], f"serve.replica=r{i}"], env=env,
                             admin_token=self.admin_token, port=port)

    def restart(self, i: int) -> ServerProcess:
        """Replica `i` again, on its port (the router's health check takes it back), as a
        supervisor would restart it: its trace writer adopts the WAL the dead one left, so every
        trace it had committed reaches the table. Serves the checkpoint the fleet started on."""
        old = self.servers[i]
        old.stop()
        self.servers[i] = self._server(i, port=old.port).wait_healthy()
        return self.servers[i]

    def __enter__(self) -> "Fleet":
        try:
            for s in self.servers:
                s.wait_healthy()
            self.router = RouterProcess([s.url for s in self.servers], self.log_dir / "router.log", self.policy,
                                        host=self.router_host, port=self.router_port)
            self.router.wait_ready()
            return self
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.router.url

    def replica_of(self, url: str) -> int:
        return next(i for i, s in enumerate(self.servers) if s.url == url)

    def flush(self) -> None:
        """Every live replica's traces so far are in committed Parquet files."""
        for s in self.servers:
            if s.proc.poll() is None:
                s.flush()

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for s in self.servers:
            s.stop()


def serve_fleet(config: str | Path, overrides: list[str], serve_cfg) -> int:
    """`loop serve` with `serve.replicas` > 1: the replicas and the router on serve.host:port, until
    SIGINT/SIGTERM. The replicas' admin token is the one the config resolves (or a fresh one,
    printed nowhere: then the fleet has no admin API for you); a replica that dies is reported."""
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    log_dir = Path(serve_cfg.trace_root).parent / "fleet-logs"
    fleet = Fleet(config, serve_cfg.model, serve_cfg.trace_root, log_dir, serve_cfg.replicas,
                  overrides=[o for o in overrides if not o.startswith(("serve.replicas=", "serve.port=", "serve.host="))],
                  admin_token=serve_cfg.resolved_admin_token(), router_host=serve_cfg.host, router_port=serve_cfg.port)
    with fleet:
        print(f"serving {serve_cfg.replicas} replicas behind vllm-router on {fleet.url} "
              f"(replicas: {', '.join(s.url for s in fleet.servers)}; logs {log_dir})", flush=True)
        dead: set[int] = set()
        while not stop:
            for i, s in enumerate(fleet.servers):
                if i not in dead and s.proc.poll() is not None:
                    dead.add(i)
                    print(f"replica r{i} ({s.url}) exited with {s.proc.returncode}; the router routes around it "
                          f"(log {s.log_path})", flush=True)
            if fleet.router.proc.poll() is not None:
                print(f"vllm-router exited with {fleet.router.proc.returncode} (log {fleet.router.log_path})", flush=True)
                return 1
            time.sleep(1)
    return 0
