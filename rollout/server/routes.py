"""Flywheel's routes beside vLLM's: /metrics, POST /v1/feedback (one object or an array),
GET /admin/status, POST /admin/flush, POST /admin/weights, POST /admin/release (a held fleet replica).

The admin API takes `Authorization: Bearer <token>` (from the env var named by serve.admin_token_env,
or the file serve.admin_token_file): 401 without a bearer token, 403 with a wrong one (or when no token is
configured: the admin API is then disabled).
"""

import asyncio
import hmac
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Mount

from rollout.server.swap import SwapError
from rollout.traces import Feedback

log = logging.getLogger("flywheel.server")
FEEDBACK_FIELDS = {"trace_id", "reward", "rating", "comment", "source", "episode_id", "feedback_id"}
RECENT_FEEDBACK_IDS = 100_000  # client-chosen feedback_ids remembered for retries
MAX_FEEDBACK_BATCH = 1000
SWAP_FIELDS = {"path", "draft_path", "mode", "clear_cache", "checkpoint_sha256", "expected_current_sha"}


def add_routes(app, st) -> None:
    """Replace vLLM's /metrics with ours (vLLM's + Flywheel's) and add feedback and admin routes."""
    app.router.routes = [r for r in app.router.routes
                         if not (isinstance(r, Mount) and r.path == "/metrics") and getattr(r, "path", "") != "/metrics"]

    @app.get("/metrics")
    async def metrics() -> Response:
        st.metrics.in_flight.set(st.engine.gate.in_flight)
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _err(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "BadRequestError" if status < 500
                                       else "InternalServerError", "code": status}}, status_code=status)

    seen: dict[str, None] = {}  # committed client feedback_ids, oldest first (an ordered set)

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        """One feedback object, or a JSON array of up to MAX_FEEDBACK_BATCH of them (all or none).
        A client-chosen `feedback_id` is an idempotency key: a retry of a committed one is answered
        again without a second row (readers also keep the first row of an id)."""
        try:
            body = await request.json()
        except ValueError:
            return _err(400, "body must be JSON: {trace_id, reward?, rating?, comment?, source?, episode_id?} "
                             "or an array of them")
        items = body if isinstance(body, list) else [body]
        if not items or len(items) > MAX_FEEDBACK_BATCH:
            return _err(400, f"a feedback array holds 1..{MAX_FEEDBACK_BATCH} objects, got {len(items)}")
        fbs = []
        for i, item in enumerate(items):
            where = f"item {i}: " if isinstance(body, list) else ""
            if not isinstance(item, dict):
                return _err(400, f"{where}feedback must be a JSON object")
            if unknown := set(item) - FEEDBACK_FIELDS:
                return _err(400, f"{where}unknown fields {sorted(unknown)}; allowed: {sorted(FEEDBACK_FIELDS)}")
            if "trace_id" not in item:
                return _err(400, f"{where}feedback needs a trace_id (a turn's x-flywheel-trace-id header)")
            fid = item.get("feedback_id")
            if fid is not None and (not isinstance(fid, str) or not 0 < len(fid) <= 128):
                return _err(400, f"{where}feedback_id must be a string of 1..128 characters")
            try:
                fbs.append(Feedback(**item))
            except (TypeError, ValueError) as e:
                return _err(400, f"{where}{e}")
        new = [fb for fb in fbs if fb.feedback_id not in seen]
        if len({fb.feedback_id for fb in new}) != len(new):
            return _err(400, "feedback_id repeats within the request")
        await st.feedback.append_many(new)
        for fb in new:
            seen[fb.feedback_id] = None
        while len(seen) > RECENT_FEEDBACK_IDS:
            del seen[next(iter(seen))]
        out = [{"feedback_id": fb.feedback_id, "trace_id": fb.trace_id} for fb in fbs]
        return {"data": out} if isinstance(body, list) else out[0]

    def _auth(request: Request) -> JSONResponse | None:
        token = st.cfg.resolved_admin_token()
        if token is None:
            return _err(403, f"admin API disabled: set ${st.cfg.admin_token_env} (or serve.admin_token_file)")
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            return JSONResponse({"error": {"message": "missing bearer token", "code": 401}}, status_code=401,
                                headers={"www-authenticate": "Bearer"})
        if not hmac.compare_digest(header[7:].strip().encode(), token.encode()):
            return _err(403, "wrong admin token")
        return None

    @app.get("/admin/status")
    async def admin_status(request: Request):
        if (denied := _auth(request)) is not None:
            return denied
        w = st.engine.weights
        return {"weight_version": w.version, "path": w.path, "checkpoint_sha256": w.checkpoint_sha256,
                "draft_path": w.draft_path,
                "in_flight": st.engine.gate.in_flight, "gate_open": st.engine.gate.is_open, "held": st.held,
                "stack": dict((w.stack or st.stack).__dict__), "failure": st.unhealthy()}

    @app.post("/admin/release")
    async def admin_release(request: Request):
        """A held fleet replica (serve.start_held) takes traffic from now on: its front door has
        checked that it serves its version group's weights."""
        if (denied := _auth(request)) is not None:
            return denied
        if st.held:
            log.info("released by the fleet's front door at weight version %d", st.engine.weights.version)
        st.held = False
        return {"held": False, "weight_version": st.engine.weights.version}

    @app.post("/admin/flush")
    async def admin_flush(request: Request):
        """Block until every trace and feedback row so far is in a Parquet part (readable)."""
        if (denied := _auth(request)) is not None:
            return denied
        try:
            await asyncio.to_thread(st.writer.flush)
            await asyncio.to_thread(st.feedback.flush)
        except Exception as e:  # a dead writer must not answer "flushed"
            log.error("flush failed: %s", e)
            return JSONResponse({"flushed": False, "error": {"message": str(e), "code": 503}}, status_code=503)
        return {"flushed": True}

    @app.post("/admin/weights")
    async def admin_weights(request: Request):
        if (denied := _auth(request)) is not None:
            return denied
        try:
            body = await request.json()
        except ValueError:
            return _err(400, 'body must be JSON: {"path": "<checkpoint folder>"}')
        usage = ('body must be {"path": "<checkpoint folder>", "draft_path"?: "<draft folder>", '
                 '"mode"?: "drain" | "keep", "clear_cache"?: true | false, "checkpoint_sha256"?: "<the weights '
                 'expected in path>", "expected_current_sha"?: "<the weights expected to serve now>"}')
        if not isinstance(body, dict) or not isinstance(body.get("path"), str) or set(body) - SWAP_FIELDS:
            return _err(400, usage)
        draft, mode, clear = body.get("draft_path"), body.get("mode", st.cfg.swap_mode), body.get("clear_cache", True)
        if draft is not None and not isinstance(draft, str):
            return _err(400, "draft_path must be a folder path")
        if mode not in ("drain", "keep") or not isinstance(clear, bool):
            return _err(400, usage)
        want, current = body.get("checkpoint_sha256"), body.get("expected_current_sha")
        if not all(x is None or isinstance(x, str) for x in (want, current)):
            return _err(400, usage)
        try:
            result = await st.swapper.swap(body["path"], draft, mode=mode, clear_cache=clear, expected_sha=want,
                                           expected_current_sha=current)
        except SwapError as e:
            log.warning("weight swap refused or rolled back: %s", e.message)
            return _err(e.status, e.message)
        log.info("weight swap: %s", result.as_dict())
        return result.as_dict()
