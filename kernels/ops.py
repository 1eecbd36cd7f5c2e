"""The public kernel functions: each picks its implementation from the spec and the device.

`impl_for(spec, device)` -> "triton" on CUDA, "torch" (the twins in reference.py) everywhere else;
every function takes `impl=` to override it (the parity tests run "triton" on the CPU under
TRITON_INTERPRET=1). There is no global switch. The Triton modules are imported on first use, so
CPU training never imports them.

fake_quant and fake_quant_act are differentiable (straight-through estimators):
- fake_quant: d/dw = 1 where qmin <= w / s + z <= qmax, else 0; if `scale` requires grad it gets
  the LSQ gradient ((q - z) - w / s inside the range, (q - z) outside, summed per group). The zero
  point is an int8 buffer and gets no gradient.
- fake_quant_act: identity gradient; a dynamic per-token scale never clips (|x| / s <= 127).
"""

import importlib

import torch

from kernels.spec import QuantSpec

IMPLS = ("torch", "triton")


def impl_for(spec: QuantSpec, device: torch.device | str) -> str:
    return "triton" if torch.device(device).type == "cuda" else "torch"


def _backend(impl: str | None, spec: QuantSpec, device: torch.device, module: str):
    impl = impl or impl_for(spec, device)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return importlib.import_module("kernels.reference")
    backend = importlib.import_module(f"kernels.{module}")
    if device.type == "cpu" and not backend.INTERPRETED:
        raise RuntimeError(f"impl='triton' on CPU tensors needs kernels.{module} imported under "
                           "TRITON_INTERPRET=1")
    return backend


def _quant(impl, spec, device):
    return _backend(impl, spec, device, "triton_quant")


def weight_qparams(w: torch.Tensor, spec: QuantSpec, *, impl: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [N, K] -> (scale [N, K//G] in spec.scale_dtype or w.dtype, zero_point int8 [N, K//G] or None).
    No grad."""
    with torch.no_grad():
        return _quant(impl, spec, w.device).weight_qparams(w.detach(), spec)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
             spec: QuantSpec, *, impl: str | None = None) -> torch.Tensor:
    """w [N, K] -> q int8 [N, K]."""
    with torch.no_grad():
        return _quant(impl, spec, w.device).quantize(w.detach(), scale, zero_point, spec)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec, *, dtype: torch.dtype | None = None, impl: str | None = None
               ) -> torch.Tensor:
    """q int8 [N, K] -> [N, K] in `dtype` (default: scale.dtype)."""
    with torch.no_grad():
        return _quant(impl, spec, q.device).dequantize(q, scale, zero_point, spec, dtype or scale.dtype)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale, zero_point, spec, impl):
        backend = _quant(impl, spec, w.device)
        out, mask = backend.fake_quant_forward(w, scale.detach(), zero_point, spec)
        ctx.save_for_backward(w, scale, zero_point, mask)
        ctx.spec, ctx.backend = spec, backend
        return out

    @staticmethod
    def backward(ctx, grad):
        w, scale, zero_point, mask = ctx.saved_tensors
        need_scale = ctx.needs_input_grad[1]
        grad_w, grad_s = ctx.backend.fake_quant_backward(grad, w, scale.detach(), zero_point, mask,
                                                         ctx.spec, need_scale)
        return grad_w, grad_s, None, None, None


def fake_quant(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec, *, impl: str | None = None) -> torch.Tensor:
    """dequantize(quantize(w)) [N, K] in w.dtype, with the straight-through backward above."""
    return _FakeQuant.apply(w, scale, zero_point, spec, impl)


class _FakeQuantAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, impl):
        return _quant(impl, spec, x.device).fake_quant_act(x, spec)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quant_act(x: torch.Tensor, spec: QuantSpec, *, impl: str | None = None) -> torch.Tensor:
    """x [..., K] -> dynamic per-token int8 fake-quant of x, same shape and dtype."""
    return _FakeQuantAct.apply(x, spec, impl)


def quantize_act(x: torch.Tensor, spec: QuantSpec, *, impl: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., K], scale float32 [..., 1])."""
    with torch.no_grad():
        return _quant(impl, spec, x.device).quantize_act(x.detach(), spec)


def int8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                spec: QuantSpec, *, out_dtype: torch.dtype = torch.float32, impl: str | None = None
                ) -> torch.Tensor:
    """x_q int8 [M, K], x_scale f32 [M, 1], w_q int8 [N, K], w_scale [N, 1] -> [M, N] out_dtype."""
    return _backend(impl, spec, x_q.device, "triton_matmul").int8_matmul(
        x_q, x_scale, w_q, w_scale, out_dtype)


def w4a16_matmul(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor,
                 zero_point: torch.Tensor | None, spec: QuantSpec, *, impl: str | None = None
                 ) -> torch.Tensor:
    """x [M, K] @ dequant(int4 weight)^T -> [M, N] in x.dtype; weight tensors as ct_format stores them."""
    return _backend(impl, spec, x.device, "triton_matmul").w4a16_matmul(
        x, w_packed, scale, zero_point, spec)
