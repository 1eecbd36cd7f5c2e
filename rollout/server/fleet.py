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

A replica that restarts (the fleet's own `restart`, `loop serve --replicas` after a crash, or
Kubernetes restarting a pod) comes back on the model its command names, which need not be what
its group serves now: replicas start held (`serve.start_held`: /health and generation answer
503), and the fleet's supervisor puts each held replica on its group's checkpoint and only then
releases it, so no request ever runs on weights its group does not serve. The same front door runs
over replicas started elsewhere (`replica_urls`, `loop serve ... serve.replica_urls=[...]`: the
StatefulSet in infra/k8s/serving.yaml); the stable checkpoint it rolled out last is kept in
`log_dir/fleet.json`, so a restarted front door puts every replica back on it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
import time
from pathlib import Path

import httpx

from rollout.cpu_placement import WORKER_SPIN_ENV
from rollout.server.fleet_admin import FleetAdmin
from rollout.server.process import AdminClient, ServerProcess
from rollout.server.router import RouterProcess
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


log = logging.getLogger("flywheel.fleet")


class RemoteReplica(AdminClient):
    """A replica started elsewhere (a StatefulSet pod) with `serve.start_held`: its URL and admin token."""

    def __init__(self, url: str, admin_token: str, trace_root: str | Path):
        self.url, self.admin_token, self.trace_root = url.rstrip("/"), admin_token, Path(trace_root)

    def wait_healthy(self, timeout: float = 1800) -> "RemoteReplica":
        """Until its admin API answers (held or not): it is up."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.admin("GET", "/admin/status", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"replica {self.url}: its admin API did not answer in {timeout} s")

    def alive(self) -> bool:
        return True  # a supervisor elsewhere restarts it; a call to a dead one fails and says so

    def stop(self, *a, **k) -> None:
        pass  # not ours to stop


class Fleet:
    """`replicas` servers of `model` sharing `trace_root` (and one admin token), behind one
    vllm-router per version group and the Splitter in front (`url`); or, with `replica_urls`,
    the same front door over replicas started elsewhere (held, with `admin_token`).

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

    def __init__(self, config: str | Path, model: str | Path | None, trace_root: str | Path, log_dir: str | Path,
                 replicas: int = 2, overrides: list[str] = (), env: dict | None = None, admin_token: str | None = None,
                 policy: str = "consistent_hash", host: str = "127.0.0.1", port: int | None = None,
                 episode_idle_s: float = 300.0, replica_urls: list[str] = (), supervise_s: float = 1.0):
        if replica_urls and not admin_token:
            raise ValueError("a front door over replicas started elsewhere needs their admin token")
        replicas = len(replica_urls) or replicas
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.log_dir, self.policy, self.host, self.port = Path(log_dir), policy, host, port
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.admin_token = admin_token or secrets.token_hex(16)
        self._start = dict(config=config, model=model, trace_root=trace_root, overrides=list(overrides), env=env or {})
        self.binds = core_slices(0 if replica_urls else replicas)
        if not replica_urls and replicas > 1 and len(os.sched_getaffinity(0)) < 2 * replicas:
            # front ends beside other replicas' workers: those must not spin 1 s after each step
            # (rollout/vllm_plugin.py; 2 replicas on 2 cores: 10.4 -> 40.4 episodes/s, bench/fleet.py)
            self._start["env"] = {WORKER_SPIN_ENV: "0.001", **self._start["env"]}
        self.servers = ([RemoteReplica(u, self.admin_token, trace_root) for u in replica_urls] if replica_urls else
                        [self._server(i) for i in range(replicas)])  # all start at once; ~30 s each here
        self.routers: dict[str, RouterProcess] = {}
        self.member = ["stable"] * replicas  # each replica's version group
        self.state_path = self.log_dir / "fleet.json"
        # group -> (checkpoint, sha); a front door over replicas started elsewhere, with no record,
        # takes what the first replica serves
        self.paths = {"stable": self._stable_on_record() or (model and str(model), None)}
        self.splitter: Splitter | None = None
        self.episode_idle_s = episode_idle_s  # an episode without feedback is over after this long idle
        self._lock = threading.RLock()  # a replica is moved or reconciled by one thread at a time
        self.supervise_s, self._stopping = supervise_s, threading.Event()

    def _server(self, i: int, port: int | None = None) -> ServerProcess:
        a = self._start
        env = {**a["env"], **({"VLLM_CPU_OMP_THREADS_BIND": self.binds[i]} if self.binds[i] else {})}
        return ServerProcess(a["config"], a["model"], a["trace_root"], self.log_dir / f"replica-{i}.log",
                             overrides=[*a["overrides"], f"serve.replica=r{i}", "serve.start_held=true"], env=env,
                             admin_token=self.admin_token, port=port)

    def _router(self, group: str, urls: list[str]) -> RouterProcess:
        return RouterProcess(urls, self.log_dir / f"router-{group}.log", self.policy).wait_ready()

    def _stable_on_record(self) -> tuple[str, str | None] | None:
        if self.state_path.exists():
            rec = json.loads(self.state_path.read_text())["stable"]
            return rec["path"], rec["checkpoint_sha256"]
        return None

    def _record(self) -> None:
        path, sha = self.paths["stable"]
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stable": {"path": path, "checkpoint_sha256": sha}}))
        os.replace(tmp, self.state_path)

    def __enter__(self) -> "Fleet":
        try:
            for s in self.servers:
                s.wait_healthy()
            if self.paths["stable"][0] is None:
                st = self.servers[0].admin("GET", "/admin/status", timeout=10).json()
                self.paths["stable"] = (st["path"], st["checkpoint_sha256"])
            for i in range(len(self.servers)):
                self._reconcile(i)  # on the stable checkpoint, released
            self.routers["stable"] = self._router("stable", [s.url for s in self.servers])
            self.splitter = Splitter({"stable": self.routers["stable"].url}, self.host, self.port or 0,
                                     idle_s=self.episode_idle_s, admin=FleetAdmin(self, self.admin_token).handle,
                                     replicas=lambda: [s.url for s in self.servers]).start()
            if self.supervise_s:
                threading.Thread(target=self._supervise, name="fleet-supervisor", daemon=True).start()
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

    def _on(self, status: dict, group: str) -> bool:
        path, sha = self.paths[group]
        if sha is not None:
            return status["checkpoint_sha256"] == sha
        return Path(status["path"]).resolve() == Path(path).resolve()

    def _reconcile(self, i: int) -> bool:
        """Replica `i` on its group's checkpoint and taking traffic: a held one (just started or
        restarted) is swapped if it must be and released; one serving anything else leaves its ring
        for the swap. True when something was done. The group's sha is learnt from the first replica
        seen on its path."""
        with self._lock:
            s, group = self.servers[i], self.member[i]
            r = s.admin("GET", "/admin/status", timeout=10)
            if r.status_code != 200:  # e.g. a replica started with another admin token: said, not guessed
                raise RuntimeError(f"replica {s.url}: GET /admin/status {r.status_code}: {r.text[:300]}")
            st = r.json()
            on = self._on(st, group)
            if on and self.paths[group][1] is None:
                self.paths[group] = (self.paths[group][0], st["checkpoint_sha256"])
            if on and not st.get("held"):
                return False
            ring = self.routers.get(group)
            if not on and not st.get("held") and ring is not None:  # serving the wrong weights: out first
                ring.remove_worker(s.url)
                self._quiesce(i)
            if not on:
                path, sha = self.paths[group]
                log.warning("replica %s serves %s, its group %s serves %s: swapping it", s.url, st["path"], group, path)
                self._swap(i, path, sha)
            r = s.admin("POST", "/admin/release", timeout=30)
            if r.status_code != 200:
                raise RuntimeError(f"replica {s.url}: POST /admin/release {r.status_code}: {r.text}")
            if not on and not st.get("held") and ring is not None:
                ring.add_worker(s.url)
            return True

    def reconcile(self) -> list[int]:
        """Every reachable replica on its group's checkpoint (see _reconcile); the ones put right."""
        fixed = []
        for i in range(len(self.servers)):
            try:
                if self.servers[i].alive() and self._reconcile(i):
                    fixed.append(i)
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # down or starting: the next round
        return fixed

    def _supervise(self) -> None:
        while not self._stopping.wait(self.supervise_s):
            try:
                for i in self.reconcile():
                    log.warning("replica %s released on its group's weights", self.servers[i].url)
            except Exception as e:  # a swap refused: said, and tried again next round
                log.error("fleet supervisor: %s: %s", type(e).__name__, e)

    def restart(self, i: int) -> ServerProcess:
        """Replica `i` again, on its port (its router's health check takes it back), as a
        supervisor would restart it: its trace writer adopts the WAL the dead one left, so every
        trace it had committed reaches the table. It starts held, and is released once it serves
        its group's checkpoint."""
        old = self.servers[i]
        old.stop()
        self.servers[i] = self._server(i, port=old.port).wait_healthy()
        self._reconcile(i)
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
        with self._lock:
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
            self.member[i], self.paths[group] = group, (str(path), sha or report.get("checkpoint_sha256"))
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
        out = [self.move(i, self.member[i], path, sha) for i in range(len(self.servers))]
        self._record()
        return out

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
        self._record()  # a restarted front door puts every replica back on it

    def rollback(self, timeout: float = 600) -> None:
        """No new canary episodes; once the open ones have ended, the canary replicas go back."""
        self.splitter.fraction = 0.0
        if "canary" not in self.routers:  # no replica ever joined it
            return
        self._wait_closed("canary", timeout)
        self.splitter.groups["canary"] = self.routers["stable"].url  # nothing pinned there now
        path, sha = self.paths["stable"]
        with self._lock:  # the supervisor sees the groups before or after, never half-way
            for i in [i for i, g in enumerate(self.member) if g == "canary"]:
                self.move(i, "stable", path, sha)
            self.splitter.groups.pop("canary")
            self.routers.pop("canary").stop()
            self.paths.pop("canary", None)

    def _rename(self, old: str, new: str) -> None:
        with self._lock:  # the supervisor sees the groups before or after, never half-way
            self._renamed(old, new)

    def _renamed(self, old: str, new: str) -> None:
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
            if s.alive():
                s.flush()

    def stop(self) -> None:
        self._stopping.set()
        if self.splitter is not None:
            self.splitter.stop()
        for r in self.routers.values():
            r.stop()
        for s in self.servers:
            s.stop()
