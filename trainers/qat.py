"""QAT in torchao's one-verb style: `quantize_(model, spec, step="prepare")`, train, then
`quantize_(model, spec, step="convert")`.

prepare: every linear layer the serving format quantizes (kernels.quant_targets: all nn.Linear
but lm_head and `full_precision`) becomes a FakeQuantLinear that shares the original Parameters
(optimizer state and state_dict keys are unchanged, so `save_pretrained` still writes the latent
full-precision weights). Its forward fake-quantizes the weight with scales recomputed from the
current weight at every step (compressed-tensors' memoryless minmax rule), straight-through
gradients, and for W8A8 also fake-quantizes the input per token as vLLM does. Inside
`fake_quant_once(model)` each layer fake-quantizes its weight once and reuses it for every
forward (one optimizer step that runs the model in pieces: a shared prompt, then its rows).

convert: each FakeQuantLinear becomes a kernels.QuantizedLinear holding the real int weights
in compressed-tensors layout. Because scales are a pure function of the weight, convert equals
requantizing the latent weights (pipelines.quantize.quantize_checkpoint) bit for bit, and a
converted layer's dequantized weight equals the fake-quant weight bit for bit.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from kernels import QuantizedLinear, QuantSpec, fake_quant, fake_quant_act, quant_targets, weight_qparams

STEPS = ("prepare", "convert")


class FakeQuantLinear(nn.Linear):
    def __init__(self, linear: nn.Linear, spec: QuantSpec, impl: str | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters, not copies
        self.spec, self.impl = spec, impl
        self.held: tuple[bool, torch.Tensor] | None = None  # (grad mode, weight) under fake_quant_once
        self.holding = False

    def fake_quantized_weight(self) -> torch.Tensor:
        scale, zero_point = weight_qparams(self.weight, self.spec, impl=self.impl)
        return fake_quant(self.weight, scale, zero_point, self.spec, impl=self.impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.activations == "int8_dynamic_token":
            x = fake_quant_act(x, self.spec, impl=self.impl)
        if not self.holding:
            return F.linear(x, self.fake_quantized_weight(), self.bias)
        if self.held is None or self.held[0] != torch.is_grad_enabled():
            self.held = (torch.is_grad_enabled(), self.fake_quantized_weight())
        return F.linear(x, self.held[1], self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, spec={self.spec.name}"


@contextmanager
def fake_quant_once(model: nn.Module) -> Iterator[None]:
    """Within: every FakeQuantLinear fake-quantizes its weight on first use and reuses it (the
    weights must not change inside; gradients of all uses add up in the one graph). Nothing
    happens to a model that was not prepared."""
    layers = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    for m in layers:
        m.holding = True
    try:
        yield
    finally:
        for m in layers:
            m.holding, m.held = False, None


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_(model: nn.Module, spec: QuantSpec, step: str = "prepare", *,
              full_precision: tuple[str, ...] | list[str] = (), impl: str | None = None) -> nn.Module:
    """In place; returns `model`. `full_precision`: linear layer names left unquantized (prepare,
    or convert of a model that was never prepared)."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    if not isinstance(spec, QuantSpec):
        raise ValueError(f"spec must be a QuantSpec, got {type(spec).__name__}")
    prepared = [n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    if step == "prepare":
        if prepared:
            raise ValueError(f"model is already prepared ({len(prepared)} FakeQuantLinear layers)")
        for name in quant_targets(model, full_precision):
            _replace(model, name, FakeQuantLinear(model.get_submodule(name), spec, impl))
        return model
    for name in prepared or quant_targets(model, full_precision):
        layer = model.get_submodule(name)
        if isinstance(layer, FakeQuantLinear) and layer.spec != spec:
            raise ValueError(f"spec differs from the one {name} was prepared with: {layer.spec}")
        _replace(model, name, QuantizedLinear.from_float(layer.weight, layer.bias, spec, impl))
    return model
