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
from rollout.traces.schema import LOGPROBS_MODES

# the trace logs log-probabilities: vLLM's *_logits modes would fill completion_logprobs with logits
SERVED_LOGPROBS_MODES = tuple(m for m in LOGPROBS_MODES if m.endswith("_logprobs"))


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
    # The admin API's bearer token comes from the environment variable `admin_token_env` names, or
    # from the file `admin_token_file` names (first line): never from the config itself, which is
    # logged to MLflow, the run's state and logs. `admin_token` exists only to refuse a value.
    admin_token: str | None = None
    admin_token_env: str = "FLYWHEEL_ADMIN_TOKEN"
    admin_token_file: str | None = None
    # Folders /admin/weights may load from (a checkpoint and each manifest entry must resolve inside
    # one), besides the folder the server started on. None: only that folder; the loop sets its
    # run's served/, checkpoints/ and drafts/ and the bootstrap cache (loop/config.py).
    weights_roots: list[str] | None = None
    # The environment variable holding the API key clients send as `Authorization: Bearer` on
    # /v1/* (vLLM's --api-key); None: no key, allowed only when `host` is a loopback address.
    api_key_env: str | None = None
    max_queue: int = 256  # requests admitted at once (running + waiting); beyond: 429 + Retry-After
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies: 413
    # Hot-swap: "drain" waits for in-flight requests (a response never spans two versions; new
    # requests wait up to drain_timeout_s, then the swap is refused); "keep" freezes them in the
    # engine, reloads, and resumes them on the new weights (their later tokens are the new
    # version's, recorded per token; new requests wait in the engine for the reload only).
    swap_mode: Literal["drain", "keep"] = "drain"
    drain_timeout_s: float = 5.0  # drain mode: the longest new requests wait for in-flight ones
    canary_tolerance: float | None = None  # hot-swap: max mean |Δ logprob| of the canary vs the
    # reference; None: what was measured for the served format on this kernel build (rollout.capabilities)
    # The served format: "auto" is the best one vLLM has kernels for here (W4A16 on AVX-512 CPUs and
    # CUDA, W8A8 on AVX2 CPUs); a full-precision model is quantized for serving (cached). A format the
    # device cannot serve fails at start, naming this key.
    quant: Literal["auto", "w4a16", "w8a8", "none"] = "auto"
    # columns per int4 scale when this server quantizes (divides 64, 192, 512); null: one scale per
    # output channel (the coarsest W4A16 vLLM's CPU kernel serves, and the lossiest)
    w4a16_group_size: int | None = 32
    # The engine's dtype when serving: "auto" is engine.dtype, except bfloat16 for a quantized format
    # (vLLM's quantized CPU kernels have no float32 path).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # vLLM's mode for the behaviour logprobs in traces: "processed_logprobs" is what the sampler drew
    # from (after temperature, top-k/top-p, penalties), whatever the request's sampling parameters;
    # "raw_logprobs" is the model's distribution before them (right only at T=1, top-p 1, no top-k)
    logprobs_mode: str = "processed_logprobs"
    # vLLM's parser for the model's tool calls (--tool-call-parser): "auto" reads the chat template's
    # markup (hermes for ChatML/Qwen, llama3_json for Llama 3, mistral; rollout/chat.py), "none"
    # serves without tool calls, else any parser name vLLM knows
    tool_call_parser: str = "auto"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # The weight version the server starts at (each hot-swap adds one). A server restarted on a
    # later checkpoint starts past the versions its trace root already holds (the loop's resume),
    # so a weight version names one checkpoint in the traces.
    weight_version: int = 0
    # This server's name in a fleet, written in each trace row's `replica` (None: host:port).
    replica: str | None = None
    # `loop serve` with replicas > 1: that many servers on free loopback ports behind vllm-router
    # on host:port (consistent hashing on X-Session-ID; rollout/server/fleet.py)
    replicas: int = 1
    # A fleet member that takes no traffic until the fleet's front door has put it on its version
    # group's weights and released it (POST /admin/release): /health and generation requests answer
    # 503 meanwhile. What a replica restarted by a supervisor (Kubernetes, the local fleet) needs:
    # it comes back on the model its command names, which may not be what its group serves now.
    start_held: bool = False
    # The front door only (splitter, one vllm-router per version group, the admin API) over these
    # replicas, started elsewhere with start_held (the StatefulSet in infra/k8s/serving.yaml).
    replica_urls: list[str] = field(default_factory=list)
    # How each version group's vllm-router places episodes: "consistent_hash" (X-Session-ID hashed
    # onto the ring: a restarted router sends every episode back to its replica) or
    # "sticky_least_loaded" (a new episode to the replica with the fewest, then kept there; the
    # table is the router's memory, so a restarted router places them again, on the same version).
    router_policy: str = "consistent_hash"
    # A fleet's episode without feedback is over once idle this long: a rollout's last stable
    # replica (and a rolled-back canary's) waits for its open episodes that long at most.
    episode_idle_s: float = 300.0

    def __post_init__(self):
        if self.admin_token is not None:
            raise ValueError(f"admin_token: a secret in the config reaches MLflow params, loop_state.json and the "
                             f"run's logs; put it in ${self.admin_token_env} (admin_token_env) or in a file named by "
                             "admin_token_file")
        if isinstance(self.weight_version, bool) or not isinstance(self.weight_version, int) or self.weight_version < 0:
            raise ValueError(f"weight_version must be an int >= 0, got {self.weight_version!r}")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if not isinstance(self.start_held, bool):
            raise ValueError(f"start_held must be true or false, got {self.start_held!r}")
        if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.replica_urls):
            raise ValueError(f"replica_urls must be http(s) URLs, got {list(self.replica_urls)!r}")
        if self.router_policy not in ("consistent_hash", "sticky_least_loaded"):
            raise ValueError(f"router_policy must be consistent_hash or sticky_least_loaded (the vllm-router "
                             f"policies that keep an episode on one replica), got {self.router_policy!r}")
        if not self.episode_idle_s > 0:
            raise ValueError(f"episode_idle_s must be > 0, got {self.episode_idle_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_queue", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        if self.canary_tolerance is not None and not self.canary_tolerance > 0:
            raise ValueError(f"canary_tolerance must be > 0 or null, got {self.canary_tolerance}")
        if self.quant not in ("auto", "w4a16", "w8a8", "none"):
            raise ValueError(f"quant must be auto, w4a16, w8a8 or none, got {self.quant!r}")
        if self.w4a16_group_size is not None and (self.w4a16_group_size <= 0 or self.w4a16_group_size % 2):
            raise ValueError(f"w4a16_group_size must be a positive even int or null (per channel), "
                             f"got {self.w4a16_group_size}")
        if self.swap_mode not in ("drain", "keep"):
            raise ValueError(f"swap_mode must be drain or keep, got {self.swap_mode!r}")
        if self.trace_durability not in ("commit", "interval"):
            raise ValueError(f"trace_durability must be commit or interval, got {self.trace_durability!r}")
        if self.logprobs_mode not in SERVED_LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {SERVED_LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.api_key_env is None and not _is_loopback(self.host):
            raise ValueError(f"api_key_env must name the environment variable holding the API key when host "
                             f"is not a loopback address (host {self.host!r} is reachable by others)")
        if not self.trace_root:
            raise ValueError("trace_root must not be empty")

    def resolved_api_key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"serve.api_key_env: the environment variable {self.api_key_env} is not set")
        return key

    def resolved_admin_token(self) -> str | None:
        """The token from $admin_token_env, else admin_token_file's first line; None: no admin API."""
        if token := os.environ.get(self.admin_token_env):
            return token
        if self.admin_token_file is None:
            return None
        try:
            token = open(os.path.expanduser(self.admin_token_file)).readline().strip()
        except OSError as e:
            raise ValueError(f"serve.admin_token_file: cannot read {self.admin_token_file}: {e.strerror}") from None
        if not token:
            raise ValueError(f"serve.admin_token_file: {self.admin_token_file} is empty")
        return token


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_tool_parser(cfg: ServeConfig, model: str) -> str | None:
    """The tool parser the server runs for `model` (None: no tool calls), or a ValueError naming
    serve.tool_call_parser when "auto" cannot tell from the chat template."""
    from rollout.chat import read_chat_template, tool_parser_for

    if cfg.tool_call_parser == "none":
        return None
    if cfg.tool_call_parser != "auto":
        return cfg.tool_call_parser
    template = read_chat_template(model)
    name = tool_parser_for(template)
    if name is None:
        why = "has no chat template" if not template else (
            "renders no tool calls" if "tool" not in template else "renders tool calls in a markup Flywheel does not "
                                                                    "recognise")
        raise ValueError(f"serve.tool_call_parser: auto cannot pick vLLM's tool parser: {model} {why}; name the "
                         "parser (hermes, llama3_json, mistral, ...) or none to serve without tool calls")
    return name


def tool_args(cfg: ServeConfig, model: str) -> list[str]:
    name = resolve_tool_parser(cfg, model)
    return [] if name is None else ["--enable-auto-tool-choice", "--tool-call-parser", name]


def vllm_cli_args(cfg: ServeConfig, engine: EngineConfig, model: str, port: int | None = None) -> list[str]:
    """vLLM OpenAI-server arguments for these settings (ours and the bare baseline's)."""
    args = [
        "--model", model, "--tokenizer", model, "--served-model-name", cfg.served_model_name,
        "--host", cfg.host, "--port", str(cfg.port if port is None else port),
        "--dtype", engine.dtype, "--max-model-len", str(engine.max_model_len),
        "--max-num-seqs", str(engine.max_num_seqs), "--seed", str(engine.seed),
        *tool_args(cfg, model),
        "--logprobs-mode", cfg.logprobs_mode, "--disable-uvicorn-access-log",
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if engine.enforce_eager:
        args.append("--enforce-eager")
    spec = cfg.speculative.vllm_dict()
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    return args
