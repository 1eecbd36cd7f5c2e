"""The base model's shape: a small decoder of a family transformers and vLLM both load natively
(Qwen2, the default; Qwen3, with its q/k norms; Llama and Mistral, with untied embeddings as their
7B/8B have; Mistral without a sliding window, as since v0.2; Gemma 3's text model, tied, its
embeddings scaled by sqrt(hidden), every layer global here)."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's CPU attention backend supports these head sizes only.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
FAMILIES = ("qwen2", "qwen3", "llama", "mistral", "gemma")


@dataclass
class ModelConfig:
    """Shape of the self-built base model (ignored when `path` points at an existing HF folder)."""

    path: str | None = None  # an existing Hugging Face folder to use instead of bootstrapping
    family: str = "qwen2"  # qwen2 | qwen3 | llama | mistral | gemma: architecture and chat format (tokenizer.FORMATS)
    vocab_size: int = 1024
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    init_std: float = 0.02

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"hidden_size/num_heads = {self.head_dim}: vLLM's CPU attention needs one of "
                             f"{VLLM_CPU_HEAD_SIZES}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def build_model(cfg: ModelConfig, tokenizer, seed: int = 0):
    import torch
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    shape = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                 num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                 intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
                 initializer_range=cfg.init_std, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id, dtype="float32")
    if cfg.family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    elif cfg.family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=cfg.head_dim, tie_word_embeddings=True))
    elif cfg.family == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, head_dim=cfg.head_dim, sliding_window=None,
                                                 tie_word_embeddings=False))
    elif cfg.family == "gemma":  # Gemma 3's text model: every layer global (no sliding window), tied embeddings
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **shape, head_dim=cfg.head_dim, query_pre_attn_scalar=cfg.head_dim, tie_word_embeddings=True,
            layer_types=["full_attention"] * cfg.num_layers, sliding_window=cfg.max_position_embeddings))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, head_dim=cfg.head_dim, tie_word_embeddings=False))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
