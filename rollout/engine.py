"""The vLLM engine as Flywheel configures it, and an offline `Generate` backend on it.

One `EngineConfig` describes the engine for offline evaluation and for the server alike, so an
evaluation measures the engine that serves. Only this module and the server build engines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rollout.episode import Completion


@dataclass
class EngineConfig:
    dtype: str = "float32"  # tiny models: fp32 keeps vLLM token-identical to transformers
    max_model_len: int = 512
    max_num_seqs: int = 64
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE; 1 GiB holds ~0.5M tokens of the tiny model
    enforce_eager: bool = True  # skips torch.compile: ~17 s instead of ~50 s to start on the CPU
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "kv_cache_gib"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def engine_kwargs(self, model_path: str) -> dict:
        return dict(
            model=model_path, tokenizer=model_path, dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching, seed=self.seed,
        )

    def apply_env(self) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))


def make_llm(model_path: str, cfg: EngineConfig, **overrides):
    """An offline `vllm.LLM` (call from under `if __name__ == "__main__":`; workers are spawned)."""
    cfg.apply_env()
    from vllm import LLM

    return LLM(**{**cfg.engine_kwargs(model_path), **overrides})


def vllm_generate(llm, seed: int | None = None):
    """A `Generate` backend on an offline engine: top-p 1, no top-k, sampled-token logprobs."""
    from vllm import SamplingParams

    def generate(prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]:
        params = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens,
                                logprobs=0, seed=seed)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        done = []
        for o in outs:
            c = o.outputs[0]
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if c.logprobs else None
            done.append(Completion(list(c.token_ids), lps, "length" if c.finish_reason == "length" else "stop"))
        return done

    return generate
