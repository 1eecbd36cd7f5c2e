"""`TracingEngine`: vLLM's `EngineClient` with an admission gate and a per-request record.

vLLM's own OpenAI serving layer (chat, completions, tool parsers, structured outputs, errors)
calls `engine_client.generate(...)`; we hand it this wrapper instead of the `AsyncLLM`. Each
`generate` call:

- waits at the `Gate` while a hot-swap holds it, then counts as in flight until its generator
  closes, so a request never spans two weight versions (the swap drains them first). HTTP
  requests are admitted earlier, by the middleware, for their whole life (headers included:
  a stream's headers go out before its first generate step); their calls skip the gate;
- forces `sampling_params.logprobs = 0` when the client asked for none: vLLM then returns the
  logprob of each sampled token, which the response serializers ignore (they read the
  request's `logprobs`, not the engine's), and the trace records it;
- accumulates the exact prompt/completion token ids, logprobs, cached prompt tokens and the
  speculative counts into a `GenRecord` on the HTTP request's `RequestContext` (a contextvar the
  ASGI middleware sets), which the middleware turns into one trace row.

Everything else is delegated to the wrapped client unchanged.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime

ACTIVE: contextvars.ContextVar["RequestContext | None"] = contextvars.ContextVar("flywheel_request", default=None)


@dataclass
class GenRecord:
    """One engine request (a chat request is one; a completions request has one per prompt)."""

    request_id: str
    weight_version: int = 0
    checkpoint_sha256: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    seed: int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    status: str = "ok"  # "ok" | "error" | "aborted"
    error: str | None = None
    first_token_at: float | None = None  # perf_counter
    num_cached_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the weight version of each completion token when they differ ("keep" swaps), else None
    token_versions: list[int] | None = None


@dataclass
class RequestContext:
    """One HTTP request, as the middleware sees it."""

    trace_id: str
    created_at: datetime
    t0: float  # perf_counter at arrival
    records: list[GenRecord] = field(default_factory=list)
    weights: "WeightState | None" = None  # set when the middleware admitted the whole request


class GateFailed(RuntimeError):
    """The server cannot serve (a swap left unknown weights): the reason, for a 503."""


class Gate:
    """Admission for generate calls; a swap closes it, waits for in-flight calls, reopens it.
    `fail(reason)` closes it for good: waiting and new calls raise `GateFailed`."""

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.waiting = 0
        self.failure: str | None = None

    @asynccontextmanager
    async def admit(self):
        if not self._open.is_set():
            self.waiting += 1
            try:
                while not self._open.is_set():
                    await self._open.wait()
            finally:
                self.waiting -= 1
        if self.failure is not None:
            raise GateFailed(self.failure)
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def close(self, timeout: float) -> bool:
        """Stop admitting; True once nothing is in flight, False if `timeout` passed first."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def hold(self) -> None:
        """Stop admitting without waiting for in-flight calls (a "keep" swap)."""
        self._open.clear()

    def open(self) -> None:
        if self.failure is None:
            self._open.set()

    def fail(self, reason: str) -> None:
        """Serve nothing more: callers waiting at the gate and new ones get GateFailed(reason)."""
        self.failure = reason
        self._open.set()  # wake the waiters; admit() raises for them

    @property
    def is_open(self) -> bool:
        return self._open.is_set() and self.failure is None


@dataclass
class WeightState:
    version: int
    path: str
    checkpoint_sha256: str
    draft_path: str | None = None
    stack: object = None  # StackFingerprint when it differs from the server's first (engine switch)


class TracingEngine:
    def __init__(self, inner, weights: WeightState, metrics=None):
        self.inner = inner
        self.gate = Gate()
        self.weights = weights
        self.metrics = metrics

    def __getattr__(self, name):  # everything but generate goes straight to vLLM's client
        return getattr(self.inner, name)

    async def generate(self, prompt, sampling_params, request_id: str, **kwargs):
        from vllm.sampling_params import RequestOutputKind

        rec = GenRecord(request_id=request_id)
        ctx = ACTIVE.get()
        if ctx is not None:
            ctx.records.append(rec)
        if getattr(sampling_params, "logprobs", 0) is None:
            sampling_params.logprobs = 0
        sp = sampling_params
        rec.temperature, rec.top_p, rec.seed = float(sp.temperature), float(sp.top_p), sp.seed
        rec.top_k = -1 if sp.top_k in (0, None) else int(sp.top_k)
        rec.max_tokens = sp.max_tokens
        delta = sp.output_kind == RequestOutputKind.DELTA
        admitted = ctx is not None and ctx.weights is not None  # the HTTP request holds the gate
        async with _nullcontext() if admitted else self.gate.admit():
            weights = ctx.weights if admitted else self.weights
            rec.weight_version, rec.checkpoint_sha256 = weights.version, weights.checkpoint_sha256
            try:
                async for out in self.inner.generate(prompt, sampling_params, request_id, **kwargs):
                    _absorb(rec, out, delta)
                    yield out
            except (asyncio.CancelledError, GeneratorExit):
                rec.status, rec.finish_reason = "aborted", rec.finish_reason or "abort"
                raise
            except BaseException as e:
                rec.status, rec.error = "error", f"{type(e).__name__}: {e}"[:2000] or type(e).__name__
                raise
            finally:
                if self.metrics is not None:
                    self.metrics.observe_record(rec)


@asynccontextmanager
async def _nullcontext():
    yield


def _absorb(rec: GenRecord, out, delta: bool) -> None:
    if not rec.prompt_token_ids and out.prompt_token_ids is not None:
        rec.prompt_token_ids = list(out.prompt_token_ids)
    if out.num_cached_tokens:
        rec.num_cached_tokens = max(rec.num_cached_tokens, int(out.num_cached_tokens))
    c = next((c for c in out.outputs if c.index == 0), None)
    if c is None:
        return
    ids = list(c.token_ids)
    lps = [lp[t].logprob for t, lp in zip(ids, c.logprobs)] if c.logprobs is not None else []
    if delta:
        rec.completion_token_ids += ids
        rec.completion_logprobs += lps
        rec.text += c.text
    else:
        rec.completion_token_ids, rec.completion_logprobs, rec.text = ids, lps, c.text
    if ids and rec.first_token_at is None:
        rec.first_token_at = time.perf_counter()
    if c.finish_reason is not None:
        rec.finish_reason = c.finish_reason
        if c.finish_reason == "abort":
            rec.status = "aborted"
    spans = getattr(c, "weight_versions", None)  # vLLM's labels (HotSwapper sets them), on the last output
    if spans and any(str(sp.version) != str(rec.weight_version) for sp in spans):
        try:
            rec.token_versions = [int(sp.version) for sp in spans for _ in range(sp.end - sp.start)]
        except ValueError:  # a label that is not ours
            rec.token_versions = None
    m = c.spec_decode_metrics
    if m is not None:
        rec.spec_draft_tokens = int(m.num_draft_tokens)
        rec.spec_accepted_tokens = int(sum(j * n for j, n in enumerate(m.histogram)))
