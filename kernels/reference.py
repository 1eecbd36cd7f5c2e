"""Torch twins of the Triton kernels: same signatures, same math, and the CPU implementation.

Every function here has a Triton twin of the same name and signature in `triton_quant.py` or
`triton_matmul.py`; `ops.py` picks one by spec and device. The math is the one stated in
`spec.py`. All quantization arithmetic runs in float32, whatever the input dtype; results are cast
to the requested dtype once, at the end.

Shapes: a weight `w` is [N, K] (out_features, in_features). With G columns per group (G = K for
per-channel) there are K // G groups: `scale` is [N, K // G] in the spec's scale dtype (default:
the weight's) and `zero_point` is int8 [N, K // G] (None when symmetric). Activations `x` are
[..., K]; their scale is float32 [..., 1].
"""

import torch

from kernels.spec import QuantSpec


def _groups(t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """[N, K] -> [N, K // G, G] view."""
    n, k = t.shape
    g = spec.group_len(k)
    return t.reshape(n, k // g, g)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def weight_qparams(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [N, K] -> (scale [N, K//G] in spec's scale dtype, zero_point int8 [N, K//G] or None)."""
    wg = _groups(w, spec).float()
    lo, hi = torch.aminmax(wg, dim=-1)
    lo, hi = lo.clamp_(max=0.0), hi.clamp_(min=0.0)
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    if spec.symmetric:
        scale = torch.maximum(-lo, hi) / ((qmax - qmin) / 2)
    else:
        scale = (hi - lo) / (qmax - qmin)
    sdt = spec.scale_torch_dtype(w.dtype)
    stored = scale.to(sdt).float()
    zero_point = None
    if not spec.symmetric:
        zp = torch.round((qmin - lo / stored).clamp_(qmin, qmax))
        zero_point = torch.where(stored == 0, 0.0, zp).to(torch.int8)
    stored = torch.where(stored == 0, _eps(sdt), stored)
    return stored.to(sdt), zero_point


def _scaled(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
            spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (v = w / scale + zero_point [N, K//G, G] float32, scale [N, K//G, 1] float32)."""
    s = scale.float().unsqueeze(-1)
    v = _groups(w, spec).float() / s
    if zero_point is not None:
        v += zero_point.float().unsqueeze(-1)
    return v, s


def quantize(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
             spec: QuantSpec) -> torch.Tensor:
    """w [N, K] -> q int8 [N, K] in [qmin, qmax]."""
    v, _ = _scaled(w, scale, zero_point, spec)
    q = torch.round(v.clamp_(spec.qmin, spec.qmax))
    return q.to(torch.int8).reshape(w.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [N, K] -> w' [N, K] in `dtype`."""
    v = _groups(q, spec).float()
    if zero_point is not None:
        v -= zero_point.float().unsqueeze(-1)
    return (v * scale.float().unsqueeze(-1)).to(dtype).reshape(q.shape)


def fake_quant_forward(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                       spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dequantize(quantize(w)) [N, K] in w.dtype, mask bool [N, K]: qmin <= w/s + z <= qmax)."""
    v, s = _scaled(w, scale, zero_point, spec)
    mask = v >= spec.qmin
    mask &= v <= spec.qmax
    v.clamp_(spec.qmin, spec.qmax).round_()
    if zero_point is not None:
        v -= zero_point.float().unsqueeze(-1)
    v += 0.0  # -0.0 -> +0.0: equal bit for bit to dequantize(quantize(w)), where ints have no -0
    return v.mul_(s).to(w.dtype).reshape(w.shape), mask.reshape(w.shape)


def fake_quant_backward(grad: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                        zero_point: torch.Tensor | None, mask: torch.Tensor, spec: QuantSpec,
                        need_scale_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Straight-through: grad_w = grad where the value was not clipped, else 0.

    grad_scale (LSQ): d w'/d s = (q - z) - w / s inside the clip range and (q - z) outside,
    summed over each group in float32 -> [N, K//G] in scale.dtype.
    """
    grad_w = torch.where(mask, grad, torch.zeros((), dtype=grad.dtype))
    if not need_scale_grad:
        return grad_w, None
    s = scale.float().unsqueeze(-1)
    ws = _groups(w, spec).float() / s
    v = ws if zero_point is None else ws + zero_point.float().unsqueeze(-1)
    q = torch.round(v.clamp(spec.qmin, spec.qmax))
    if zero_point is not None:
        q -= zero_point.float().unsqueeze(-1)
    term = torch.where(_groups(mask, spec), q - ws, q)
    grad_scale = (_groups(grad, spec).float() * term).sum(-1)
    return grad_w, grad_scale.to(scale.dtype)


def quantize_act(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., K], scale float32 [..., 1]); vLLM's dynamic per-token int8."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale == 0, 0.0, 1.0 / scale)
    q = torch.round((xf * inv).clamp_(-128.0, 127.0)).to(torch.int8)
    return q, scale


def fake_quant_act(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """x [..., K] -> q * scale [..., K] in x.dtype."""
    q, scale = quantize_act(x, spec)
    return (q.float() * scale).to(x.dtype)


def _int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [N, K]^T -> int32 [M, N], exact."""
    if a.device.type == "cpu":
        return torch._int_mm(a.contiguous(), b.t().contiguous())
    return (a.double() @ b.double().t()).to(torch.int32)  # exact: |sum| < 2^53


def int8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """x_q int8 [M, K], x_scale f32 [M, 1], w_q int8 [N, K], w_scale [N, 1] -> [M, N] out_dtype.

    acc = x_q @ w_q^T in int32; out = (float(acc) * x_scale) * w_scale^T, in that order.
    """
    acc = _int_matmul(x_q, w_q)
    out = acc.float() * x_scale.float()
    out *= w_scale.float().reshape(1, -1)
    return out.to(out_dtype)


def w4a16_matmul(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor,
                 zero_point: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """x [M, K] float @ int4 weight^T -> [M, N] in x.dtype.

    w_packed int32 [N, K // 8], scale [N, K // G], zero_point int32 [ceil(N / 8), K // G] or None:
    the compressed-tensors `pack-quantized` tensors (kernels/ct_format.py), read as stored.
    """
    from kernels.ct_format import unpack_int4

    n, k = w_packed.shape[0], x.shape[-1]
    q = unpack_int4(w_packed, k)
    zp = None if zero_point is None else unpack_int4(zero_point.t(), n).t()
    w = dequantize(q, scale, zp, spec, x.dtype)
    return x @ w.t()
