"""A checkpoint as the engine will load it, checked tensor by tensor, as a torch model (the *twin*).

    check_candidate(folder, serving)   what the hot-swap checks (files against the manifest, same
                                       architecture, tokenizer and format), then every tensor: readable,
                                       finite, none missing or unexpected, each of the shape the
                                       architecture (and, for quantized layers, the format) needs
    load_twin(folder)                  the model computing what the engine computes, in float32:
                                       quantized layers hold their dequantized checkpoint weights
                                       (and quantize their input per token for W8A8)

A bad checkpoint raises CandidateError with the reason, before anything runs on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kernels import QuantSpec, compress_weight, fake_quant_act, from_compressed
from kernels.ops import dequantize


class CandidateError(ValueError):
    """A checkpoint that must not serve: the message says why."""


def _spec_of(folder: Path) -> QuantSpec | None:
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" not in config:
        return None
    from pipelines.quantize import load_manifest

    try:
        return load_manifest(folder).spec
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CandidateError(f"{folder}: quantized, but without a readable Flywheel manifest to name its "
                             f"spec ({type(e).__name__}: {e})") from None


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt") as h:
                for key in h.keys():
                    tensors[key] = h.get_tensor(key)
        except Exception as e:  # truncated or corrupt: safetensors raises its own types
            raise CandidateError(f"{f.name}: cannot be read ({type(e).__name__}: {e})") from None
    for key, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = (~torch.isfinite(t)).sum().item()
            raise CandidateError(f"tensor {key} holds {bad} NaN or infinite values")
    return tensors


def _model(folder: Path, meta: bool) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.__dict__.pop("quantization_config", None)
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _tied(model: nn.Module) -> set[str]:
    """Parameter names that share another's tensor (lm_head = embed_tokens): stored once."""
    return ({n for n, _ in model.named_parameters(remove_duplicate=False)} -
            {n for n, _ in model.named_parameters()})


def _expected(model: nn.Module, spec: QuantSpec | None, quantized: set[str]) -> dict[str, tuple]:
    """{tensor name: shape} the checkpoint must hold."""
    want, tied = {}, _tied(model)
    for key, t in model.state_dict().items():
        if key in tied:
            continue
        module, _, leaf = key.rpartition(".")
        if module in quantized and leaf == "weight":
            shapes = compress_weight(torch.zeros(t.shape), spec)
            want |= {f"{module}.{n}": tuple(v.shape) for n, v in shapes.items()}
        else:
            want[key] = tuple(t.shape)
    return want


def check_candidate(folder: str | Path, serving: str | Path | None = None) -> str:
    """Raise CandidateError unless `folder` can replace `serving`; returns its weight hash."""
    from rollout.server.swap import SwapError, check_folder, needs_new_engine

    from rollout.capabilities import detect, serving_format
    from rollout.server.tracing import quant_format

    folder = Path(folder)
    if (folder / "config.json").is_file():
        fmt, caps = serving_format(quant_format(str(folder))), detect()
        if not caps.can_serve(fmt):
            raise CandidateError(f"{folder} is {fmt}, which this machine cannot serve: {caps.why_not(fmt)}")
    if serving is not None:
        try:
            return check_folder(folder, serving, same_quant=not needs_new_engine(str(folder), current=str(serving)))
        except SwapError as e:
            raise CandidateError(e.message) from None
    if not (folder / "config.json").is_file():
        raise CandidateError(f"{folder}: not a Hugging Face folder (no config.json)")
    from rollout.artifacts import checkpoint_sha256

    return checkpoint_sha256(folder)


def load_twin(folder: str | Path) -> nn.Module:
    """The checked checkpoint as an eval-mode float32 torch model (CandidateError if it is bad)."""
    folder = Path(folder)
    spec = _spec_of(folder)
    tensors = _read_tensors(folder)
    model = _model(folder, meta=True)
    config = json.loads((folder / "config.json").read_text())
    ignore = set(config.get("quantization_config", {}).get("ignore", []))
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantized = (linears - ignore) if spec is not None else set()
    want = _expected(model, spec, quantized)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise CandidateError(f"missing tensor{'s' * (len(missing) > 1)} {', '.join(missing[:4])}")
    unexpected = sorted(set(tensors) - set(want))
    if unexpected:
        raise CandidateError(f"unexpected tensor{'s' * (len(unexpected) > 1)} {', '.join(unexpected[:4])}")
    for key, shape in want.items():
        if tuple(tensors[key].shape) != shape:
            raise CandidateError(f"tensor {key} has shape {tuple(tensors[key].shape)}, the architecture "
                                 f"in config.json needs {shape}")
    state = {}
    for name in quantized:
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".") and k[len(name) + 1:]
                 in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight")}
        q, scale, zp = from_compressed(local, spec)
        state[name + ".weight"] = dequantize(q, scale, zp, spec, dtype=torch.float32)
    model = _model(folder, meta=False)
    keys = set(model.state_dict())
    state |= {k: v.float() for k, v in tensors.items() if k in keys and k not in state}
    result = model.load_state_dict(state, strict=False)
    if set(result.missing_keys) - _tied(model) or result.unexpected_keys:
        raise CandidateError(f"tensors do not fit the model: missing {result.missing_keys[:4]}, "
                             f"unexpected {result.unexpected_keys[:4]}")
    if spec is not None and spec.activations == "int8_dynamic_token":
        for name in quantized:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, _ActQuantLinear(model.get_submodule(name), spec))
    return model.eval()


class _ActQuantLinear(nn.Module):
    """W8A8: the input quantized per token as vLLM does, then the dequantized int8 weight."""

    def __init__(self, linear: nn.Linear, spec: QuantSpec):
        super().__init__()
        self.weight, self.bias, self.spec = linear.weight, linear.bias, spec

    def forward(self, x):
        return F.linear(fake_quant_act(x, self.spec), self.weight, self.bias)
