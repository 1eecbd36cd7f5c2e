"""The ASGI layer in front of vLLM's app: limits, overload, trace ids, one trace row per request.

For the generation routes (`/v1/chat/completions`, `/v1/completions`) it
- reads the body once (413 past `max_body_bytes`) and replays it to vLLM's handler;
- answers 429 with `Retry-After` when `max_queue` requests are already admitted;
- admits the request at the hot-swap `Gate` for its whole life (waiting while a swap runs), so
  its weight version, header included, is fixed;
- sets a `RequestContext` the `TracingEngine` fills, and sends `x-flywheel-trace-id` (and
  `x-flywheel-weight-version`) with the response headers;
- parses the response as it passes (non-streamed JSON, or the SSE chunks) into the assistant
  message, and writes the trace row. In "commit" durability what completes a response for its
  client (a JSON response's status line and body; a stream's `data: [DONE]`) is held until the
  row is fsynced, so a client that saw a complete response has a durable trace, and a row that
  cannot be committed turns the answer into a 503 (or a final SSE error event); while the
  writer is failed, commit mode answers generation requests 503 up front, and /health says why.
  In "interval" durability nothing waits.
Requests that fail (4xx/5xx, 429 included) or are aborted by the client are traced too, with
their status; only a body refused for its size (413) is not (it is never read whole).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime, timezone

from rollout.server.engine import ACTIVE, GateFailed, RequestContext
from rollout.server.output import OutputParser
from rollout.server.tracing import build_traces

log = logging.getLogger("flywheel.server")

TRACED_PATHS = ("/v1/chat/completions", "/v1/completions")


def _json_response(status: int, message: str, err_type: str, headers: list | None = None):
    body = json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])}, \
        {"type": "http.response.body", "body": body, "more_body": False}


def _salted(scope, body: bytes, req: dict, version: int) -> tuple[dict, bytes]:
    """The request with vLLM's `cache_salt` extended by the weight version it runs on: a prefix
    computed under one version's weights is never reused under another's (a swap that keeps the
    prefix cache, `clear_cache: false`, or a "keep" swap's later requests), while requests of one
    version share their prefixes as before. A client's own salt stays a part of it."""
    if not req or "prompt" not in req and "messages" not in req:
        return scope, body
    if "cache_salt" in req:  # the client's own salt: a part of ours (the body written again, ~40 us)
        if not isinstance(req["cache_salt"], str) or not req["cache_salt"]:
            return scope, body  # vLLM's own 400 for a bad salt
        body = json.dumps({**req, "cache_salt": f"{req['cache_salt']}|v{version}"}).encode()
    else:  # the salt spliced in as the object's first key: ~1 us, not ~40 for a 300-token prompt
        body = b'{"cache_salt": "v%d", ' % version + body.lstrip()[1:]
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}, body


def _tool_schema_problem(body: bytes) -> str | None:
    """vLLM accepts any `parameters` unless a tool is strict; reject ones that are no JSON Schema."""
    if b'"tools"' not in body:
        return None
    try:
        tools = json.loads(body).get("tools")
    except (ValueError, AttributeError):
        return None  # vLLM's validation answers malformed bodies
    if not isinstance(tools, list):
        return None
    from jsonschema import Draft202012Validator, SchemaError

    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if params is None:
            continue
        if not isinstance(params, dict):
            return f"tools[{i}].function.parameters must be a JSON Schema object"
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as e:
            return f"tools[{i}].function.parameters is not a valid JSON Schema: {e.message}"
    return None


def _replay(body: bytes, receive):
    """A `receive` that yields the already-read body once, then the real channel (disconnects)."""
    sent = [False]

    async def replay():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class FlywheelMiddleware:
    def __init__(self, app, state):
        self.app = app
        self.state = state  # rollout.server.app.ServerState

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/health" and (problem := self.state.unhealthy()):
            start, end = _json_response(503, problem, "ServiceUnavailableError")
            await send(start)
            return await send(end)
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS or scope["method"] != "POST":
            if scope["type"] == "http" and scope.get("method") in ("POST", "PUT"):
                return await self._limited(scope, receive, send)
            return await self.app(scope, receive, send)
        st = self.state
        body = await self._read_body(receive, send)
        if body is None:
            return
        if st.admitted >= st.cfg.max_queue:
            st.metrics.rejected.inc()
            return await self._reject(scope, body, send, 429, f"server is at its queue limit "
                                      f"({st.cfg.max_queue} requests); retry later", "RateLimitError",
                                      [(b"retry-after", b"1")])
        if (problem := _tool_schema_problem(body)) is not None:
            return await self._reject(scope, body, send, 400, problem, "BadRequestError")
        if st.held:  # its weights are not yet confirmed as its version group's
            return await self._reject(scope, body, send, 503, st.unhealthy(), "ServiceUnavailableError",
                                      [(b"retry-after", b"1")])
        if st.cfg.trace_durability == "commit" and (failure := st.writer.failure):
            return await self._reject(scope, body, send, 503, f"traces cannot be made durable ({failure}); "
                                      "refusing in commit durability", "ServiceUnavailableError")
        st.admitted += 1
        try:
            await self._traced(scope, body, receive, send, st)
        finally:
            st.admitted -= 1

    async def _traced(self, scope, body: bytes, receive, send, st):
        ctx = RequestContext(trace_id=uuid.uuid4().hex, created_at=datetime.now(timezone.utc), t0=time.perf_counter())
        try:
            req = json.loads(body) if body else None
        except ValueError:
            req = None
        req = req if isinstance(req, dict) else {}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parser = OutputParser(chat=scope["path"].endswith("chat/completions"))
        status_code = [0]
        finished = [False]
        trace_id_hdr = (b"x-flywheel-trace-id", ctx.trace_id.encode())

        commit = st.writer.cfg.durability == "commit"
        held_start: list = [None]  # commit mode, non-streamed: the status waits for the commit
        refused = [False]  # the trace could not be committed and the client was told: send no more

        async def record(final: bool) -> Exception | None:
            """Write the request's rows; in commit mode (final) wait until durable and return the
            first error, else log errors (an aborted request is written without waiting)."""
            traces = build_traces(ctx, req, headers, parser, status_code[0], st, aborted=not final)
            for t in traces:
                try:
                    if final and commit:
                        await st.writer.append(t)
                    else:
                        st.writer.append_nowait(t)
                except Exception as e:
                    log.exception("trace %s could not be written", t.trace_id)
                    if final and commit:
                        return e
            return None

        async def send_wrapped(message):
            if refused[0]:
                return
            if message["type"] == "http.response.start":
                status_code[0] = message["status"]
                message = dict(message)
                version = ctx.weights.version if ctx.weights else st.engine.weights.version
                message["headers"] = list(message.get("headers", [])) + [
                    trace_id_hdr, (b"x-flywheel-weight-version", str(version).encode())]
                if commit and b"text/event-stream" not in dict(message["headers"]).get(b"content-type", b""):
                    held_start[0] = message
                    return
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                parser.feed(chunk)
                # A stream is complete for its client at `data: [DONE]`: that chunk leaves only
                # once the trace is durable (commit mode); so does a JSON response's status line.
                complete = not message.get("more_body", False) or (commit and b"data: [DONE]" in chunk)
                if complete and not finished[0]:
                    finished[0] = True
                    if (error := await record(final=True)) is not None:
                        return await _refuse_uncommitted(error)
            if held_start[0] is not None:
                start, held_start[0] = held_start[0], None
                await send(start)
            await send(message)

        async def _refuse_uncommitted(error: Exception) -> None:
            """The trace could not be made durable: the client must not take the answer as served."""
            refused[0] = True
            text = f"the response was generated but its trace could not be made durable ({error})"
            if held_start[0] is not None:  # nothing sent yet: a plain 503
                held_start[0] = None
                for m in _json_response(503, text, "ServiceUnavailableError", [trace_id_hdr]):
                    await send(m)
                return
            event = json.dumps({"error": {"message": text, "type": "ServiceUnavailableError", "code": 503}})
            await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": False})

        token = ACTIVE.set(ctx)
        try:
            async with st.engine.gate.admit():  # waits while a hot-swap runs; held to the last byte
                ctx.weights = st.engine.weights
                scope, salted = _salted(scope, body, req, ctx.weights.version)
                await self.app(scope, _replay(salted, receive), send_wrapped)
        except GateFailed as e:  # a failed swap left unknown weights: refuse, never serve them
            for message in _json_response(503, str(e), "ServiceUnavailableError"):
                await send_wrapped(message)
        finally:
            ACTIVE.reset(token)
            if not finished[0]:  # the client went away, or the app raised before the last chunk
                finished[0] = True
                await record(final=False)

    async def _reject(self, scope, body: bytes, send, status: int, message: str, err_type: str,
                      headers: list | None = None) -> None:
        """Answer before vLLM sees the request, and trace it as an error (without waiting)."""
        ctx = RequestContext(trace_id=uuid.uuid4().hex, created_at=datetime.now(timezone.utc), t0=time.perf_counter())
        start, end = _json_response(status, message, err_type,
                                    [(b"x-flywheel-trace-id", ctx.trace_id.encode()), *(headers or [])])
        await send(start)
        await send(end)
        try:
            req = json.loads(body)
        except ValueError:
            req = {}
        parser = OutputParser(chat=scope["path"].endswith("chat/completions"))
        parser.feed(end["body"])
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            for t in build_traces(ctx, req if isinstance(req, dict) else {}, hdrs, parser, status, self.state,
                                  aborted=False):
                self.state.writer.append_nowait(t)
        except Exception:
            log.exception("trace of a rejected request could not be written")

    async def _read_body(self, receive, send) -> bytes | None:
        limit = self.state.cfg.max_body_bytes
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                start, end = _json_response(413, f"request body exceeds {limit} bytes", "BadRequestError")
                await send(start)
                await send(end)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _limited(self, scope, receive, send):
        body = await self._read_body(receive, send)
        if body is None:
            return

        await self.app(scope, _replay(body, receive), send)
