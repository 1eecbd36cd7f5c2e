"""The fleet's front door while a new policy rolls out: each episode is pinned to one version group.

    splitter = Splitter({"stable": router_a.url}).start()     # a thread with its own event loop
    splitter.groups["canary"] = router_b.url; splitter.fraction = 0.1
    ... splitter.open_episodes("stable")                     # pinned episodes seen in the last idle_s

vllm-router has no weighted split and knows nothing of versions: a replica that leaves its ring
hands its sessions to whichever replicas follow it on the ring, whatever they serve. So the fleet
runs one vllm-router per version group (consistent hashing on X-Session-ID inside the group) and
this splitter in front: the first request of an episode (X-Session-ID, else
x-flywheel-episode-id) picks a group, `fraction` of new episodes the canary's by a hash of the
episode id, and every later turn of that episode goes to the same group, whatever `fraction` has
become since. An episode is open until its feedback arrives (`POST /v1/feedback` naming it) or it
has been idle for `idle_s`; a group's last replica leaves only once no episode is open on it. A replica moves between groups only out of both rings, so an episode's turns all run
on one version; an episode without a key goes to "stable". Bodies and headers pass through
unchanged; responses stream back as they come; a stream cut off by a replica's death ends with an
SSE error event; feedback goes straight to a replica (vllm-router drops headers on it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time

from aiohttp import ClientSession, ClientTimeout, web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def bucket(key: str) -> float:
    """A stable point in [0, 1) for an episode id."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2 ** 64


class Splitter:
    def __init__(self, groups: dict[str, str], host: str = "127.0.0.1", port: int = 0, idle_s: float = 300.0,
                 admin=None, replicas=None):
        self.groups = dict(groups)  # name -> base URL (a router)
        self.admin = admin  # an async handler for /admin/* (the fleet's: rollout/server/fleet_admin.py)
        self.replicas = replicas  # () -> every replica's URL: feedback goes to one directly (see _target)
        self.fraction = 0.0  # of new episodes to "canary"
        self.host, self.port, self.idle_s = host, port, idle_s
        self.pins: dict[str, tuple[str, float, int]] = {}  # episode -> (group, last activity, requests running)
        self._pins_lock = threading.Lock()  # the loop's thread pins, the fleet's thread counts and drops
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def group_of(self, key: str | None) -> str:
        if not key:
            return "stable"
        with self._pins_lock:
            group, _, busy = self.pins.get(key) or (
                "canary" if "canary" in self.groups and bucket(key) < self.fraction else "stable", 0.0, 0)
            self.pins[key] = (group, time.monotonic(), busy + 1)
        return group

    def _done(self, key: str | None) -> None:
        """A request of episode `key` ended: idle from now (the pin stays until feedback or idle_s)."""
        with self._pins_lock:
            if key in self.pins:
                group, _, busy = self.pins[key]
                self.pins[key] = (group, time.monotonic(), busy - 1)

    def open_episodes(self, group: str) -> int:
        """Episodes pinned to `group` with a request running or one in the last `idle_s` (older pins
        are dropped)."""
        now = time.monotonic()
        with self._pins_lock:  # a request still running keeps its episode open, however long it runs
            self.pins = {k: v for k, v in self.pins.items() if v[2] > 0 or now - v[1] < self.idle_s}
            return sum(1 for g, _, _ in self.pins.values() if g == group)

    def _close(self, body: bytes) -> None:
        """Feedback ends an episode: the episodes it names are no longer open (their pins go)."""
        try:
            rows = json.loads(body)
        except ValueError:
            return
        ended = {r.get("episode_id") for r in (rows if isinstance(rows, list) else [rows]) if isinstance(r, dict)}
        with self._pins_lock:
            for ep in ended:
                self.pins.pop(ep, None)

    def rename(self, old: str, new: str) -> None:
        """`old`'s episodes are pinned to `new` (a canary that became the stable group)."""
        with self._pins_lock:
            self.pins = {k: ((new if g == old else g), t, b) for k, (g, t, b) in self.pins.items()}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.admin is not None and request.path.startswith("/admin/"):
            return await self.admin(request)
        key = request.headers.get("x-session-id") or request.headers.get("x-flywheel-episode-id")
        group = self.group_of(key)
        try:
            return await self._forward(request, group)
        finally:
            self._done(key)

    def _targets(self, request: web.Request, group: str, body: bytes) -> list[str]:
        """Where a request goes: its group's router; feedback straight to a replica instead (any
        replica stores it in the one trace root), because vllm-router forwards routes it does not
        know without the client's headers, its API key among them. The replica is chosen by a hash
        of the body, so a retried post reaches the replica that remembers its feedback_id; the
        others follow in order, in case it is down."""
        if request.path == "/v1/feedback" and self.replicas is not None and (urls := sorted(self.replicas())):
            k = int(bucket(body.decode(errors="replace")) * len(urls))
            return urls[k:] + urls[:k]
        return [self.groups.get(group) or self.groups["stable"]]  # a group renamed away meanwhile: stable

    async def _forward(self, request: web.Request, group: str) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/v1/feedback":
            self._close(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        errors = []
        for base in self._targets(request, group, body):
            try:
                upstream = await self._client.request(request.method, base + request.rel_url.raw_path_qs,
                                                       headers=headers, data=body)
                break
            except Exception as e:  # down: the next target, else a clean 502 (the client retries)
                errors.append(f"{base}: {type(e).__name__}: {e}")
        else:
            return web.json_response({"error": {"message": f"{group}: " + "; ".join(errors), "code": 502}}, status=502)
        async with upstream:
            resp = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP | {"content-encoding"}})
            resp.headers["x-flywheel-version-group"] = group
            await resp.prepare(request)
            sse, tail, why = upstream.headers.get("content-type", "").startswith("text/event-stream"), b"", None
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                    tail = (tail + chunk)[-4096:]
            except (ConnectionResetError, asyncio.CancelledError):
                raise  # the client left
            except Exception as e:  # the replica died mid-response
                why = f"{type(e).__name__}: {e}"
            last = tail.rstrip().rsplit(b"data: ", 1)[-1]  # the stream's last event
            if sse and last != b"[DONE]" and not last.startswith(b'{"error"'):
                # a stream that ended without its end: the replica serving it failed (or was killed)
                # mid-response. Said as the server says its own mid-stream failures, so a client
                # sees a clean error event, not a truncated stream, and abandons or retries the turn.
                msg = f"the replica serving this stream failed mid-response ({why or 'it closed the stream'})"
                await resp.write(b"data: " + json.dumps({"error": {
                    "message": msg, "type": "ServiceUnavailableError", "code": 503}}).encode() + b"\n\n")
            await resp.write_eof()
            return resp

    def start(self) -> "Splitter":
        threading.Thread(target=self._run, name="splitter", daemon=True).start()
        if not self._ready.wait(30):
            raise RuntimeError("splitter did not start")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)

        async def up():
            self._client = ClientSession(timeout=ClientTimeout(total=1800), auto_decompress=False)
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(up())
        self._loop.run_forever()

    def stop(self) -> None:
        if self._loop is None:
            return

        async def down():
            await self._runner.cleanup()
            await self._client.close()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
