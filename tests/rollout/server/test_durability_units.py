"""Commit durability through the real middleware and the real trace writer, in front of a
scripted vLLM app (the leaf: it answers like vLLM's chat route without an engine), so the order
of what the client sees against what is durable can be pinned down exactly."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.server.app import ServerState
from rollout.server.config import ServeConfig
from rollout.server.engine import TracingEngine, WeightState
from rollout.server.metrics import FlywheelMetrics
from rollout.server.middleware import FlywheelMiddleware
from rollout.traces import StackFingerprint, TraceConfig, TraceWriter

STACK = StackFingerprint(engine="vllm", engine_version="test", quant_format="none", kv_cache_dtype="auto",
                         device="cpu", device_name="test", torch_version="test", flywheel_version="test")
CHUNK = {"choices": [{"index": 0, "delta": {"content": "42"}, "finish_reason": "stop"}]}


def scripted_app(stream: bool):
    async def app(scope, receive, send):
        await receive()
        if stream:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": f"data: {json.dumps(CHUNK)}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "42"},
                                            "finish_reason": "stop"}]}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
    return app


class Client:
    """One ASGI request; `events` interleaves what the client received with the writer's commits."""

    def __init__(self, middleware, events):
        self.middleware, self.events = middleware, events

    async def request(self, method: str, path: str, body: dict | None = None) -> list[dict]:
        raw = json.dumps(body or {}).encode()
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body":
                self.events.append(("client", message.get("body", b"")))
            else:
                self.events.append(("client-status", message["status"]))

        await self.middleware({"type": "http", "method": method, "path": path, "headers": [], "query_string": b""},
                              receive, send)
        return sent


def _server(tmp_path, stream: bool, events: list):
    writer = TraceWriter(TraceConfig(root=tmp_path, durability="commit"))
    append = writer.append

    async def observed_append(trace):
        await asyncio.sleep(0.05)  # a slow disk: the client must wait for it
        await append(trace)
        events.append(("committed", trace.trace_id))

    writer.append = observed_append
    st = ServerState(cfg=ServeConfig(trace_root=str(tmp_path)), engine=TracingEngine(None, WeightState(0, "/m", "0" * 64)),
                     writer=writer, feedback=None, metrics=FlywheelMetrics(), swapper=None, stack=STACK,
                     speculator_version=None)
    return FlywheelMiddleware(scripted_app(stream), st), writer


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_the_client_sees_a_complete_answer_only_once_its_trace_is_durable(stream, tmp_path):
    events: list = []
    middleware, writer = _server(tmp_path, stream, events)
    try:
        asyncio.run(Client(middleware, events).request("POST", "/v1/chat/completions", {"model": "m", "messages": []}))
    finally:
        writer.close()
    committed = next(i for i, e in enumerate(events) if e[0] == "committed")
    if stream:
        done = next(i for i, e in enumerate(events) if e[0] == "client" and b"[DONE]" in e[1])
        assert committed < done, events
    else:
        status = next(i for i, e in enumerate(events) if e[0] == "client-status")
        assert committed < status, events  # not even the status line went out before the commit


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_failed_writer_is_visible_and_refuses_in_commit_mode(stream, tmp_path):
    events: list = []
    middleware, writer = _server(tmp_path, stream, events)

    def bug():
        raise RuntimeError("injected committer bug")

    writer._log._open_segment = bug  # the committer thread dies in its next group commit
    client = Client(middleware, events)
    try:
        sent = asyncio.run(client.request("POST", "/v1/chat/completions", {"model": "m", "messages": []}))
        bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        if stream:  # the status went out with the first chunk; the end is an error, not [DONE]
            assert b"[DONE]" not in bodies and b"could not be made durable" in bodies
        else:
            assert sent[0]["status"] == 503 and b"could not be made durable" in bodies
        assert "committer died" in writer.failure
        health = asyncio.run(client.request("GET", "/health"))
        assert health[0]["status"] == 503 and b"trace writer" in health[1]["body"]
        again = asyncio.run(client.request("POST", "/v1/chat/completions", {"model": "m", "messages": []}))
        assert again[0]["status"] == 503 and b"refusing in commit durability" in again[1]["body"]
        with pytest.raises(RuntimeError, match="committer died"):
            writer.flush()  # what /admin/flush runs: it answers 503, never {"flushed": true}
    finally:
        try:
            writer.close()
        except RuntimeError:
            pass
