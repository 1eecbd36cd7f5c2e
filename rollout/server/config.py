"""The server's config: `ServeConfig` (HTTP, limits, admin, traces) around the shared `EngineConfig`.

`vllm_cli_args` turns it into vLLM's own server arguments, so this server and vLLM's bare OpenAI
server (the benchmark's baseline) run the very same engine settings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal

from rollout.engine import EngineConfig

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class SpeculativeConfig:
    method: Literal["none", "ngram", "draft"] = "none"
    draft_model: str | None = None  # a smaller model with the same tokenizer (method "draft")
    num_speculative_tokens: int = 3
    ngram_min: int = 1  # method "ngram": prompt-lookup n-gram sizes
    ngram_max: int = 4

    def __post_init__(self):
        if self.method not in ("none", "ngram", "draft"):
            raise ValueError(f"method must be none, ngram or draft, got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("draft_model must be set when method is 'draft'")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min/ngram_max must satisfy 1 <= ngram_min <= ngram_max, "
                             f"got {self.ngram_min}/{self.ngram_max}")

    def vllm_dict(self) -> dict | None:
        if self.method == "none":
            return None
        if self.method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                    "prompt_lookup_min": self.ngram_min, "prompt_lookup_max": self.ngram_max}
        return {"model": self.draft_model, "num_speculative_tokens": self.num_speculative_tokens}


@dataclass
class ServeConfig:
    model: str | None = None  # HF folder (full precision or compressed-tensors); None: the bootstrap base
    served_model_name: str = "flywheel"
    host: str = "127.0.0.1"
    port: int = 8000
    trace_root: str = "runs/serve/data"  # traces under <trace_root>/traces, feedback beside
    trace_durability: Literal["commit", "interval"] = "commit"
    admin_token: str | None = None  # the admin API's bearer token; else read from admin_token_env
    admin_token_env: str = "FLYWHEEL_ADMIN_TOKEN"
    max_queue: int = 256  # requests admitted at once (running + waiting); beyond: 429 + Retry-After
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies: 413
    drain_timeout_s: float = 30.0  # hot-swap: how long in-flight requests may take to finish
    canary_tolerance: float = 0.05  # hot-swap: max mean |Δ logprob| of the canary vs the reference
    logprobs_mode: str = "raw_logprobs"  # vLLM's mode for the behaviour logprobs in traces
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_queue", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("drain_timeout_s", "canary_tolerance"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.trace_durability not in ("commit", "interval"):
            raise ValueError(f"trace_durability must be commit or interval, got {self.trace_durability!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not self.trace_root:
            raise ValueError("trace_root must not be empty")

    def resolved_admin_token(self) -> str | None:
        return self.admin_token or os.environ.get(self.admin_token_env) or None


def vllm_cli_args(cfg: ServeConfig, engine: EngineConfig, model: str, port: int | None = None) -> list[str]:
    """vLLM OpenAI-server arguments for these settings (ours and the bare baseline's)."""
    args = [
        "--model", model, "--tokenizer", model, "--served-model-name", cfg.served_model_name,
        "--host", cfg.host, "--port", str(cfg.port if port is None else port),
        "--dtype", engine.dtype, "--max-model-len", str(engine.max_model_len),
        "--max-num-seqs", str(engine.max_num_seqs), "--seed", str(engine.seed),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--logprobs-mode", cfg.logprobs_mode, "--disable-uvicorn-access-log",
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if engine.enforce_eager:
        args.append("--enforce-eager")
    spec = cfg.speculative.vllm_dict()
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    return args
