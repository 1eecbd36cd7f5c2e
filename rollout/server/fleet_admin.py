"""The fleet's admin API on its front door: what a lone server's `/admin/*` answers, for N replicas.

So the loop promotes into a fleet as into one server (`collect.endpoint` = the fleet's URL):

    GET  /admin/status    the stable group's checkpoint and version, `in_flight` summed, each replica's status
    POST /admin/flush     every replica's traces and feedback so far in Parquet
    POST /admin/weights   {"path", "checkpoint_sha256"?, "expected_current_sha"?, "mode"?: "drain",
                           "canary"?: {"fraction": 0.5, "seconds": 0, "margin": 0.05, "logprob_margin": 0.5}}

A swap rolls the fleet version by version (Fleet.canary, then promote): every episode stays on the
version it began on. With `canary.seconds` > 0 the canary serves its share of live traffic that
long and is promoted only if rollout.server.canary_check passes on it; else it is rolled back and
the answer is a 409 naming the check. A replica that refuses the checkpoint (its own checks and
canary) rolls the canary back: 409 with the replica's reason; serving is left as it was. "keep"
swaps are a lone server's (they would put two versions in one episode): 400 here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from datetime import datetime, timezone

from aiohttp import web

FIELDS = {"path", "mode", "checkpoint_sha256", "expected_current_sha", "canary", "clear_cache"}


def _err(code: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=code)


class FleetAdmin:
    def __init__(self, fleet, token: str | None):
        self.fleet, self.token = fleet, token
        self._lock = asyncio.Lock()  # one rollout at a time

    async def handle(self, request: web.Request) -> web.Response:
        header = request.headers.get("authorization", "")
        if self.token is None:
            return _err(403, "admin API disabled: the fleet was started without an admin token")
        if not header.lower().startswith("bearer "):
            return _err(401, "missing bearer token")
        if not hmac.compare_digest(header[7:].strip().encode(), self.token.encode()):
            return _err(403, "wrong admin token")
        if request.method == "GET" and request.path == "/admin/status":
            return web.json_response(await asyncio.to_thread(self.status))
        if request.method == "POST" and request.path == "/admin/flush":
            await asyncio.to_thread(self.fleet.flush)
            return web.json_response({"flushed": True})
        if request.method == "POST" and request.path == "/admin/weights":
            try:
                body = json.loads(await request.read())
            except ValueError:
                return _err(400, 'body must be JSON: {"path": "<checkpoint folder>"}')
            if not isinstance(body, dict) or not isinstance(body.get("path"), str) or set(body) - FIELDS:
                return _err(400, f"body must be an object with path and only {sorted(FIELDS)}")
            if body.get("mode", "drain") != "drain":
                return _err(400, "a fleet swaps in drain mode only (a keep swap would put two versions in one episode)")
            async with self._lock:
                code, out = await asyncio.to_thread(self.rollout, body)
            return web.json_response(out, status=code)
        return _err(404, f"no fleet admin route {request.method} {request.path}")

    def status(self) -> dict:
        each = [s.admin("GET", "/admin/status", timeout=30).json() for s in self.fleet.servers]
        stable = next(st for st, g in zip(each, self.fleet.member) if g == "stable")
        return {**stable, "in_flight": sum(st["in_flight"] for st in each), "fleet": True,
                "replicas": [{"replica": f"r{i}", "group": g, **{k: st[k] for k in ("weight_version", "checkpoint_sha256",
                                                                                   "path", "in_flight")}}
                             for i, (st, g) in enumerate(zip(each, self.fleet.member))]}

    def rollout(self, body: dict) -> tuple[int, dict]:
        from rollout.server.canary_check import compare_versions

        fleet, path, sha = self.fleet, body["path"], body.get("checkpoint_sha256")
        spec = {"fraction": 0.5, "seconds": 0.0, "margin": 0.05, "logprob_margin": 0.5, **(body.get("canary") or {})}
        now = self.status()
        if (want := body.get("expected_current_sha")) and now["checkpoint_sha256"] != want:
            return 409, {"error": {"message": f"the fleet serves {now['checkpoint_sha256']}, not the expected {want}",
                                   "code": 409}}
        t0, since = time.perf_counter(), datetime.now(timezone.utc)
        try:
            fleet.canary(path, sha, float(spec["fraction"]))
        except Exception as e:  # a replica refused the checkpoint: every replica back on stable
            fleet.rollback()
            return 409, {"error": {"message": f"canary refused: {e}", "code": 409}}
        canary_v = next(s for s, g in zip(self.status()["replicas"], fleet.member) if g == "canary")["weight_version"]
        check = None
        if float(spec["seconds"]) > 0:
            time.sleep(float(spec["seconds"]))
            fleet.flush()
            check = compare_versions(fleet.servers[0].trace_root, now["weight_version"], canary_v, since=since,
                                     margin=float(spec["margin"]), logprob_margin=float(spec["logprob_margin"]))
            if not check.passed:
                fleet.rollback()
                return 409, {"error": {"message": f"canary rolled back: {check.summary()}", "code": 409}}
        fleet.promote()
        after = self.status()
        return 200, {"weight_version": after["weight_version"], "checkpoint_sha256": after["checkpoint_sha256"],
                     "path": after["path"], "seconds": time.perf_counter() - t0, "fleet": True,
                     "canary": check.summary() if check else "no live check (canary.seconds 0)",
                     "replicas": after["replicas"]}
