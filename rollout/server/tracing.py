"""From one HTTP request (context, body, response) to schema-v1 `Trace` rows.

One row per engine request: a chat request is one; a completions request with k prompts is k
rows (the first carries the request's trace id, the others `<trace_id>-<i>`). A request that
failed before reaching the engine (a 4xx) is one row with no tokens and status "error".
`episode_id`/`turn` come from the body (`episode_id`, `turn`, e.g. the openai client's
`extra_body`) or the headers `x-flywheel-episode-id` / `x-flywheel-turn`; a request with neither
takes its episode from `X-Session-ID`, the header a router keeps a session on one replica by.
Each row names the replica that answered (`serve.replica`) and its trace writer.
"""

from __future__ import annotations

import json
import platform
import time
from functools import lru_cache
from pathlib import Path

from rollout.server.engine import GenRecord, RequestContext
from rollout.server.output import OutputParser
from rollout.traces import SamplingInfo, StackFingerprint, Trace


def quant_format(model_path: str) -> str:
    """"none", or e.g. "compressed-tensors-w4a16" / "compressed-tensors-w8a8", from config.json."""
    try:
        qc = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return "unknown"
    if not qc:
        return "none"
    method = qc.get("quant_method", "unknown")
    groups = qc.get("config_groups") or {}
    for g in groups.values():
        w, a = g.get("weights") or {}, g.get("input_activations")
        bits = w.get("num_bits")
        return f"{method}-w{bits}a{a.get('num_bits') if a else 16}"
    return method


@lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def stack_fingerprint(model_path: str, kv_cache_dtype: str = "auto", caps=None) -> StackFingerprint:
    import importlib.metadata as md

    from rollout.capabilities import detect, serving_format

    import torch
    import vllm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        fw = md.version("flywheel")
    except md.PackageNotFoundError:
        fw = "unknown"
    caps = caps or detect()
    fmt = quant_format(model_path)
    return StackFingerprint(
        engine="vllm", engine_version=getattr(vllm, "__version__", "unknown"),
        quant_format=fmt, kv_cache_dtype=kv_cache_dtype, device=device,
        device_name=torch.cuda.get_device_name(0) if device == "cuda" else _cpu_name(),
        torch_version=torch.__version__, flywheel_version=fw, kernel_build=caps.kernel_build,
        w4a16_activations=caps.w4a16_activations if serving_format(fmt) == "w4a16" else None,
    )


def _turn(req: dict, headers: dict) -> int | None:
    for v in (req.get("turn"), headers.get("x-flywheel-turn")):
        if v is None:
            continue
        try:
            t = int(v)
        except (TypeError, ValueError):
            continue
        if t >= 0:
            return t
    return None


def _episode(req: dict, headers: dict) -> str | None:
    v = req.get("episode_id", headers.get("x-flywheel-episode-id", headers.get("x-session-id")))
    return str(v) if v not in (None, "") else None


def build_traces(ctx: RequestContext, req: dict, headers: dict, parser: OutputParser, status_code: int, st,
                 aborted: bool) -> list[Trace]:
    out, finish, error = parser.result()
    e2e_ms = (time.perf_counter() - ctx.t0) * 1000
    chat = parser.chat
    messages = req.get("messages") if chat else req.get("prompt")
    w = ctx.weights or st.engine.weights
    common = dict(
        model=str(req.get("model") or st.cfg.served_model_name), stack=w.stack or st.stack, created_at=ctx.created_at,
        messages=json.dumps(messages), tools=json.dumps(req["tools"]) if req.get("tools") else None,
        episode_id=_episode(req, headers), turn=_turn(req, headers), e2e_ms=e2e_ms,
        speculator_version=f"draft:{w.draft_path}" if w.draft_path else st.speculator_version,
        replica=st.cfg.replica or f"{st.cfg.host}:{st.cfg.port}", writer_id=getattr(st.writer, "writer_id", None),
    )
    records = ctx.records or [GenRecord(request_id=ctx.trace_id, weight_version=w.version,
                                        checkpoint_sha256=w.checkpoint_sha256,
                                        temperature=float(req.get("temperature") or 0.0)
                                        if isinstance(req.get("temperature"), (int, float)) else 1.0,
                                        status="error")]
    traces = []
    for i, rec in enumerate(records):
        status, err = rec.status, rec.error
        if status_code >= 400 or error:
            status, err = "error", error or err or f"HTTP {status_code}"
        elif aborted and status == "ok":
            status = "aborted"
        if status == "error" and not err:
            err = f"HTTP {status_code}"
        lps = rec.completion_logprobs
        if len(lps) != len(rec.completion_token_ids):
            lps = [] if status != "ok" else lps
        try:
            sampling = SamplingInfo(temperature=max(0.0, rec.temperature), top_p=rec.top_p, top_k=rec.top_k,
                                    max_tokens=rec.max_tokens, seed=rec.seed, logprobs_mode=st.cfg.logprobs_mode)
        except ValueError:
            sampling = SamplingInfo(temperature=1.0, logprobs_mode=st.cfg.logprobs_mode)
        message = out if i == 0 and out else {"content": rec.text}
        traces.append(Trace(
            trace_id=ctx.trace_id if i == 0 else f"{ctx.trace_id}-{i}", request_id=rec.request_id,
            weight_version=rec.weight_version, checkpoint_sha256=rec.checkpoint_sha256, sampling=sampling,
            prompt_token_ids=rec.prompt_token_ids, completion_token_ids=rec.completion_token_ids,
            completion_logprobs=lps, output=json.dumps(message),
            finish_reason=(finish if i == 0 and finish else rec.finish_reason), status=status, error=err,
            ttft_ms=(rec.first_token_at - ctx.t0) * 1000 if rec.first_token_at else None,
            num_cached_prompt_tokens=rec.num_cached_tokens, spec_draft_tokens=rec.spec_draft_tokens,
            spec_accepted_tokens=rec.spec_accepted_tokens,
            completion_weight_versions=rec.token_versions
            if rec.token_versions and len(rec.token_versions) == len(rec.completion_token_ids) else None,
            **common,
        ))
    return traces
