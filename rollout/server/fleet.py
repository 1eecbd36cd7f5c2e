"""N `loop serve` replicas behind vllm-router, on one machine: what `loop serve --replicas N`, the
benchmarks and the tests start.

    with Fleet("conf/agent_rl.yaml", model=path, trace_root=root, log_dir=logs, replicas=2) as fleet:
        httpx.post(fleet.url + "/v1/completions", headers={"X-Session-ID": episode_id}, json=...)
        fleet.canary(new_path, sha, fraction=0.5); ...; fleet.promote()   # or fleet.rollback()
        fleet.flush()                      # every replica's traces so far are on disk

    client ─▶ Splitter (fleet.url: pins each episode to a version group)
                 ├─▶ vllm-router "stable" (consistent_hash on X-Session-ID) ─▶ replicas on version v
                 └─▶ vllm-router "canary" (while a new version rolls out)   ─▶ replicas on version v+1

Why vllm-router, and why `consistent_hash` (its flags and hash keys: infra/README.md): it is
the router the vLLM project ships (a Rust core on PyPI, health checks, retries, runtime
`add_worker`/`remove_worker`), and its consistent_hash policy keys on the `X-Session-ID` header,
which the collector and the Agents SDK client set to the episode id: every turn of an episode
reaches the replica that holds its prefix in cache, and a replica that leaves the ring moves only
its own episodes. Its cache_aware default matches request text and would split an episode whose
turns' texts diverge. It has no weighted split and does not know versions: hence one router per
version group and the Splitter (rollout/server/splitter.py) in front.

Every replica writes into the one trace root (its own WAL and writer id; `replica` in each row),
so the dataset build reads the fleet's traces as one table; replicas serving one checkpoint carry
one version number (rollout/server/versions.py, shared). On a CPU machine each replica's vLLM
worker gets its own slice of the cores (`VLLM_CPU_OMP_THREADS_BIND`): two replicas on 2 cores
get one core each, and each front end runs beside the other replica's worker, which then must not
busy-wait after its steps (`FLYWHEEL_WORKER_SPIN_S`, set where there are fewer than 2 cores a replica).
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rollout.cpu_placement import WORKER_SPIN_ENV
from rollout.server.fleet_admin import FleetAdmin
from rollout.server.process import ServerProcess, _die_with_parent, free_port
from rollout.server.splitter import Splitter


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


class Fleet:
    """`replicas` servers of `model` sharing `trace_root` (and one admin token), behind one
    vllm-router per version group and the Splitter in front (`url`).

    A new policy rolls out in three steps, each replica moving out of its group's ring, swapping
    (drain mode: no request spans two versions) and joining the other group's ring, so the fleet
    never serves with fewer than N-1 replicas and every episode stays on the version it began on:

        fleet.canary(path, sha, fraction=0.5)   # ceil(fraction N) replicas (1..N-1) serve `path`;
                                                # `fraction` of new episodes pinned to them
        fleet.promote()                         # all new episodes to the canary; the stable
                                                # replicas follow one by one (the last once its
                                                # open episodes have ended); canary becomes stable
        fleet.rollback()                        # no new canary episodes; once the open ones ended,
                                                # the canary replicas go back to the stable weights
    """

    def __init__(self, config: str | Path, model: str | Path, trace_root: str | Path, log_dir: str | Path,
                 replicas: int = 2, overrides: list[str] = (), env: dict | None = None, admin_token: str | None = None,
                 policy: str = "consistent_hash", host: str = "127.0.0.1", port: int | None = None,
                 episode_idle_s: float = 300.0):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.log_dir, self.policy, self.host, self.port = Path(log_dir), policy, host, port
        self.admin_token = admin_token or secrets.token_hex(16)
        self._start = dict(config=config, model=model, trace_root=trace_root, overrides=list(overrides), env=env or {})
        self.binds = core_slices(replicas)
        if replicas > 1 and len(os.sched_getaffinity(0)) < 2 * replicas:
            # front ends beside other replicas' workers: those must not spin 1 s after each step
            # (rollout/vllm_plugin.py; 2 replicas on 2 cores: 10.4 -> 40.4 episodes/s, bench/fleet.py)
            self._start["env"] = {WORKER_SPIN_ENV: "0.001", **self._start["env"]}
        self.servers = [self._server(i) for i in range(replicas)]  # all start at once; ~30 s each here
        self.routers: dict[str, RouterProcess] = {}
        self.member = ["stable"] * replicas  # each replica's version group
        self.paths = {"stable": (str(model), None)}  # group -> (checkpoint folder, sha)
        self.splitter: Splitter | None = None
        self.episode_idle_s = episode_idle_s  # an episode without feedback is over after this long idle

    def _server(self, i: int, port: int | None = None) -> ServerProcess:
        a = self._start
        env = {**a["env"], **({"VLLM_CPU_OMP_THREADS_BIND": self.binds[i]} if self.binds[i] else {})}
        return ServerProcess(a["config"], a["model"], a["trace_root"], self.log_dir / f"replica-{i}.log",
                             overrides=[*a["overrides"], f"serve.replica=r{i}"], env=env,
                             admin_token=self.admin_token, port=port)

    def _router(self, group: str, urls: list[str]) -> RouterProcess:
        return RouterProcess(urls, self.log_dir / f"router-{group}.log", self.policy).wait_ready()

    def __enter__(self) -> "Fleet":
        try:
            for s in self.servers:
                s.wait_healthy()
            self.routers["stable"] = self._router("stable", [s.url for s in self.servers])
            self.splitter = Splitter({"stable": self.routers["stable"].url}, self.host, self.port or 0,
                                     idle_s=self.episode_idle_s, admin=FleetAdmin(self, self.admin_token).handle).start()
            return self
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.splitter.url

    @property
    def router(self) -> RouterProcess:
        return self.routers["stable"]

    def restart(self, i: int) -> ServerProcess:
        """Replica `i` again, on its port (its router's health check takes it back), as a
        supervisor would restart it: its trace writer adopts the WAL the dead one left, so every
        trace it had committed reaches the table. It serves its group's checkpoint."""
        old = self.servers[i]
        old.stop()
        self.servers[i] = self._server(i, port=old.port).wait_healthy()
        path, sha = self.paths[self.member[i]]
        if path != str(self._start["model"]):
            self._swap(i, path, sha)
        return self.servers[i]

    def _swap(self, i: int, path: str, sha: str | None, timeout: float = 600) -> dict:
        r = self.servers[i].admin("POST", "/admin/weights", timeout=timeout, json={
            "path": str(path), "mode": "drain", **({"checkpoint_sha256": sha} if sha else {})})
        if r.status_code != 200:
            raise RuntimeError(f"replica r{i}: POST /admin/weights {r.status_code}: {r.text}")
        return r.json()

    def move(self, i: int, group: str, path: str, sha: str | None = None) -> dict:
        """Replica `i` out of its group's ring, onto `path`, into `group`'s ring (a router of its
        own started for a new group). The swap's report, plus `seconds`."""
        s, t0, old = self.servers[i], time.perf_counter(), self.member[i]
        self.routers[old].remove_worker(s.url)
        try:
            self._quiesce(i)
            report = self._swap(i, path, sha)
        except BaseException:
            self.routers[old].add_worker(s.url)  # refused: it serves its old group as before
            raise
        if group in self.routers:
            self.routers[group].add_worker(s.url)
        else:
            self.routers[group] = self._router(group, [s.url])
            self.splitter.groups[group] = self.routers[group].url
        self.member[i], self.paths[group] = group, (str(path), sha)
        return {**report, "seconds": time.perf_counter() - t0}

    def _quiesce(self, i: int, quiet_s: float = 1.0, timeout: float = 120) -> None:
        """Out of the ring, replica `i` finishes what it was sent: no request in flight for
        `quiet_s`. A drain swap alone would hold a request the router sent just before the
        removal at the replica's gate and run it on the new weights, the next turn of an episode
        begun on the old ones."""
        deadline, quiet_since = time.time() + timeout, None
        while time.time() < deadline:
            busy = self.servers[i].admin("GET", "/admin/status", timeout=10).json()["in_flight"]
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.time()
            elif time.time() - quiet_since >= quiet_s:
                return
            time.sleep(0.1)
        raise TimeoutError(f"replica r{i} still had requests in flight after {timeout} s out of the ring")

    def roll(self, path: str, sha: str | None = None) -> list[dict]:
        """Every replica onto `path` in place, one at a time (capacity N-1; no canary)."""
        return [self.move(i, self.member[i], path, sha) for i in range(len(self.servers))]

    def canary(self, path: str, sha: str | None = None, fraction: float = 0.5) -> list[int]:
        """ceil(fraction N) replicas, at least 1 and at most N-1, serve `path` as the canary group;
        `fraction` of new episodes (by a hash of their id) are pinned to it."""
        n = len(self.servers)
        if n < 2:
            raise ValueError("a canary needs 2 replicas or more (one keeps serving the stable version)")
        k = min(n - 1, max(1, math.ceil(fraction * n)))
        moved = [i for i in range(n - k, n)]
        for i in moved:
            self.move(i, "canary", path, sha)
        self.splitter.fraction = fraction
        return moved

    def _wait_closed(self, group: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while self.splitter.open_episodes(group) and time.time() < deadline:
            time.sleep(0.5)
        if left := self.splitter.open_episodes(group):
            raise TimeoutError(f"{left} {group} episodes still open after {timeout} s")

    def promote(self, timeout: float = 600) -> None:
        """The canary everywhere: new episodes all to it, then each stable replica moves (the last
        one once the stable episodes it alone can serve have ended); the canary group becomes stable."""
        path, sha = self.paths["canary"]
        self.splitter.fraction = 1.0
        stable = [i for i, g in enumerate(self.member) if g == "stable"]
        for j, i in enumerate(stable):
            if j == len(stable) - 1:
                self._wait_closed("stable", timeout)
                # nothing is pinned to stable now: whatever still asks for it (a request without an
                # episode, feedback) goes to the canary's ring before the last stable replica leaves
                self.splitter.groups["stable"] = self.routers["canary"].url
            self.move(i, "canary", path, sha)
        self._rename("canary", "stable")

    def rollback(self, timeout: float = 600) -> None:
        """No new canary episodes; once the open ones have ended, the canary replicas go back."""
        self.splitter.fraction = 0.0
        if "canary" not in self.routers:  # no replica ever joined it
            return
        self._wait_closed("canary", timeout)
        self.splitter.groups["canary"] = self.routers["stable"].url  # nothing pinned there now
        path, sha = self.paths["stable"]
        for i in [i for i, g in enumerate(self.member) if g == "canary"]:
            self.move(i, "stable", path, sha)
        self.splitter.groups.pop("canary")
        self.routers.pop("canary").stop()
        self.paths.pop("canary", None)

    def _rename(self, old: str, new: str) -> None:
        empty = self.routers.pop(new)
        self.routers[new] = self.routers.pop(old)
        self.paths[new] = self.paths.pop(old)
        self.member = [new if g == old else g for g in self.member]
        self.splitter.groups[new] = self.routers[new].url
        self.splitter.rename(old, new)
        self.splitter.fraction = 0.0
        self.splitter.groups.pop(old)
        empty.stop()  # no group points at it any more

    def flush(self) -> None:
        """Every live replica's traces so far are in committed Parquet files."""
        for s in self.servers:
            if s.proc.poll() is None:
                s.flush()

    def stop(self) -> None:
        if self.splitter is not None:
            self.splitter.stop()
        for r in self.routers.values():
            r.stop()
        for s in self.servers:
            s.stop()


def serve_fleet(config: str | Path, overrides: list[str], serve_cfg) -> int:
    """`loop serve` with `serve.replicas` > 1: the replicas and the router on serve.host:port, until
    SIGINT/SIGTERM. The fleet's admin API (rollout/server/fleet_admin.py) on serve.port and each
    replica's take the token the config resolves (without one, a fresh token printed nowhere: no
    admin API for you); a replica that dies is reported."""
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    log_dir = Path(serve_cfg.trace_root).parent / "fleet-logs"
    fleet = Fleet(config, serve_cfg.model, serve_cfg.trace_root, log_dir, serve_cfg.replicas,
                  overrides=[o for o in overrides if not o.startswith(("serve.replicas=", "serve.port=", "serve.host="))],
                  admin_token=serve_cfg.resolved_admin_token(), host=serve_cfg.host, port=serve_cfg.port)
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
