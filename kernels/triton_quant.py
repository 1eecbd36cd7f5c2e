"""Triton twins of the quantize / dequantize / fake-quant / activation-quant functions in reference.py.

Same names, signatures and math as the torch twins (spec.py states the math). To round exactly
like torch on a GPU:
- every division is `tl.math.div_rn` (Triton's `/` lowers to the approximate `div.full.f32`);
- launches pass `enable_fp_fusion=False` (no FMA contraction of a multiply and an add);
- round-half-to-even is `_rint` below, built from floor (libdevice's rint is unavailable in the
  interpreter), exact for the clamped values it sees (|v| <= 128) and keeping the sign of zero;
- float32 -> bfloat16 goes through `_cast`, an explicit round-to-nearest-even on the bits (the
  interpreter's own conversion truncates, the GPU's rounds to nearest even).
On the CPU these kernels run only under TRITON_INTERPRET=1 (the parity tests); it must be set when
this module is imported, because `triton.jit` reads it when it decorates (INTERPRETED records it).

Weight kernels run one program per (block of BLOCK_N rows, one group of G columns) and loop over
the group in BLOCK_K chunks, so one scale / zero point per row is loaded once. Inputs are made
contiguous; outputs are allocated here.
"""

import torch
import triton
import triton.language as tl

from kernels.spec import QuantSpec

BLOCK_N = 16
_LAUNCH = {"enable_fp_fusion": False}
INTERPRETED = triton.knobs.runtime.interpret


@triton.jit
def _rint(v):
    fl = tl.floor(v)
    d = v - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), fl + 1.0, fl)
    return tl.where(r == 0.0, v * 0.0, r)


@triton.jit
def _cast(v, dtype: tl.constexpr):
    """float32 -> dtype, rounding to nearest even."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = b + ((b >> 16) & 1) + 0x7FFF
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _qparams_kernel(w_ptr, scale_ptr, zp_ptr, N, K, G, NG,
                    QMIN: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, EPS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    g = tl.program_id(1)
    rmask = rows < N
    lo = tl.zeros([BLOCK_N], dtype=tl.float32)
    hi = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, G, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < G)[None, :]
        x = tl.load(w_ptr + rows[:, None] * K + (g * G + cols)[None, :], mask=m, other=0.0)
        lo = tl.minimum(lo, tl.min(x.to(tl.float32), axis=1))
        hi = tl.maximum(hi, tl.max(x.to(tl.float32), axis=1))
    if SYM:
        scale = tl.math.div_rn(tl.maximum(-lo, hi), tl.full([BLOCK_N], (QMAX - QMIN) / 2, tl.float32))
    else:
        scale = tl.math.div_rn(hi - lo, tl.full([BLOCK_N], QMAX - QMIN, tl.float32))
    stored = _cast(scale, scale_ptr.dtype.element_ty).to(tl.float32)
    if not SYM:
        zp = tl.minimum(tl.maximum(QMIN - tl.math.div_rn(lo, stored), QMIN), QMAX)
        zp = tl.where(stored == 0.0, 0.0, _rint(zp))
        tl.store(zp_ptr + rows * NG + g, zp.to(tl.int8), mask=rmask)
    stored = tl.where(stored == 0.0, EPS, stored)
    tl.store(scale_ptr + rows * NG + g, _cast(stored, scale_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _quant_kernel(w_ptr, scale_ptr, zp_ptr, out_ptr, mask_ptr, N, K, G, NG,
                  QMIN: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, FAKE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """FAKE=False: out = q int8. FAKE=True: out = (q - z) * s in out dtype, mask = not clipped."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    g = tl.program_id(1)
    rmask = rows < N
    s = tl.load(scale_ptr + rows * NG + g, mask=rmask, other=1.0).to(tl.float32)
    z = tl.zeros([BLOCK_N], dtype=tl.float32)
    if not SYM:
        z = tl.load(zp_ptr + rows * NG + g, mask=rmask, other=0).to(tl.float32)
    for k0 in range(0, G, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < G)[None, :]
        offs = rows[:, None] * K + (g * G + cols)[None, :]
        x = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
        if not SYM:
            v = v + z[:, None]
        q = _rint(tl.minimum(tl.maximum(v, QMIN), QMAX))
        if FAKE:
            y = ((q - z[:, None]) + 0.0) * s[:, None]  # +0.0: an int has no -0
            tl.store(out_ptr + offs, _cast(y, out_ptr.dtype.element_ty), mask=m)
            tl.store(mask_ptr + offs, (v >= QMIN) & (v <= QMAX), mask=m)
        else:
            tl.store(out_ptr + offs, q.to(tl.int8), mask=m)


@triton.jit
def _dequant_kernel(q_ptr, scale_ptr, zp_ptr, out_ptr, N, K, G, NG, SYM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    g = tl.program_id(1)
    rmask = rows < N
    s = tl.load(scale_ptr + rows * NG + g, mask=rmask, other=1.0).to(tl.float32)
    for k0 in range(0, G, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < G)[None, :]
        offs = rows[:, None] * K + (g * G + cols)[None, :]
        v = tl.load(q_ptr + offs, mask=m, other=0).to(tl.float32)
        if not SYM:
            v = v - tl.load(zp_ptr + rows * NG + g, mask=rmask, other=0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs, _cast(v * s[:, None], out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _fq_backward_kernel(grad_ptr, w_ptr, scale_ptr, zp_ptr, mask_ptr, gw_ptr, gs_ptr, N, K, G, NG,
                        QMIN: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr,
                        SCALE_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    g = tl.program_id(1)
    rmask = rows < N
    s = tl.load(scale_ptr + rows * NG + g, mask=rmask, other=1.0).to(tl.float32)
    z = tl.zeros([BLOCK_N], dtype=tl.float32)
    if not SYM:
        z = tl.load(zp_ptr + rows * NG + g, mask=rmask, other=0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, G, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < G)[None, :]
        offs = rows[:, None] * K + (g * G + cols)[None, :]
        gr = tl.load(grad_ptr + offs, mask=m, other=0.0)
        inside = tl.load(mask_ptr + offs, mask=m, other=0) != 0
        tl.store(gw_ptr + offs, tl.where(inside, gr, 0.0).to(gw_ptr.dtype.element_ty), mask=m)
        if SCALE_GRAD:
            ws = tl.math.div_rn(tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32),
                                tl.broadcast_to(s[:, None], gr.shape))
            q = _rint(tl.minimum(tl.maximum(ws + z[:, None], QMIN), QMAX)) - z[:, None]
            term = tl.where(inside, q - ws, q)
            acc += tl.sum(tl.where(m, gr.to(tl.float32) * term, 0.0), axis=1)
    if SCALE_GRAD:
        tl.store(gs_ptr + rows * NG + g, _cast(acc, gs_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, FAKE: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per token. FAKE=False: q int8 + scale f32; FAKE=True: q * scale in x dtype."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    one = tl.full([1], 1.0, tl.float32)
    scale = tl.math.div_rn(tl.max(amax, axis=0) * one, one * 127.0)
    inv = tl.where(scale == 0.0, 0.0, tl.math.div_rn(one, scale))
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = _rint(tl.minimum(tl.maximum(x * inv, -128.0), 127.0))
        if FAKE:
            tl.store(q_ptr + row * K + cols, _cast((q + 0.0) * scale, q_ptr.dtype.element_ty), mask=cols < K)
        else:
            tl.store(q_ptr + row * K + cols, q.to(tl.int8), mask=cols < K)
    if not FAKE:
        tl.store(s_ptr + row + tl.arange(0, 1), scale)


def _layout(w: torch.Tensor, spec: QuantSpec) -> tuple[int, int, int, int, int, tuple[int, int]]:
    n, k = w.shape
    g = spec.group_len(k)
    block_k = min(triton.next_power_of_2(g), 256)
    return n, k, g, k // g, block_k, (triton.cdiv(n, BLOCK_N), k // g)


def weight_qparams(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = w.contiguous()
    n, k, g, ng, block_k, grid = _layout(w, spec)
    sdt = spec.scale_torch_dtype(w.dtype)
    scale = torch.empty((n, ng), dtype=sdt, device=w.device)
    zp = None if spec.symmetric else torch.empty((n, ng), dtype=torch.int8, device=w.device)
    _qparams_kernel[grid](w, scale, scale if zp is None else zp, n, k, g, ng,
                          QMIN=spec.qmin, QMAX=spec.qmax, SYM=spec.symmetric,
                          EPS=torch.finfo(sdt).eps, BLOCK_N=BLOCK_N, BLOCK_K=block_k, **_LAUNCH)
    return scale, zp


def quantize(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
             spec: QuantSpec) -> torch.Tensor:
    w, scale = w.contiguous(), scale.contiguous()
    n, k, g, ng, block_k, grid = _layout(w, spec)
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    zp = scale if zero_point is None else zero_point.contiguous()
    _quant_kernel[grid](w, scale, zp, q, q, n, k, g, ng, QMIN=spec.qmin, QMAX=spec.qmax,
                        SYM=zero_point is None, FAKE=False, BLOCK_N=BLOCK_N, BLOCK_K=block_k, **_LAUNCH)
    return q


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    q, scale = q.contiguous(), scale.contiguous()
    n, k, g, ng, block_k, grid = _layout(q, spec)
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    zp = scale if zero_point is None else zero_point.contiguous()
    _dequant_kernel[grid](q, scale, zp, out, n, k, g, ng, SYM=zero_point is None,
                          BLOCK_N=BLOCK_N, BLOCK_K=block_k, **_LAUNCH)
    return out


def fake_quant_forward(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                       spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    w, scale = w.contiguous(), scale.contiguous()
    n, k, g, ng, block_k, grid = _layout(w, spec)
    out = torch.empty_like(w)
    mask = torch.empty((n, k), dtype=torch.bool, device=w.device)
    zp = scale if zero_point is None else zero_point.contiguous()
    _quant_kernel[grid](w, scale, zp, out, mask, n, k, g, ng, QMIN=spec.qmin, QMAX=spec.qmax,
                        SYM=zero_point is None, FAKE=True, BLOCK_N=BLOCK_N, BLOCK_K=block_k, **_LAUNCH)
    return out, mask


def fake_quant_backward(grad: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                        zero_point: torch.Tensor | None, mask: torch.Tensor, spec: QuantSpec,
                        need_scale_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    grad, w, scale, mask = grad.contiguous(), w.contiguous(), scale.contiguous(), mask.contiguous()
    n, k, g, ng, block_k, grid = _layout(w, spec)
    grad_w = torch.empty_like(grad)
    grad_s = torch.empty((n, ng), dtype=scale.dtype, device=w.device) if need_scale_grad else None
    zp = scale if zero_point is None else zero_point.contiguous()
    _fq_backward_kernel[grid](grad, w, scale, zp, mask, grad_w, scale if grad_s is None else grad_s,
                              n, k, g, ng, QMIN=spec.qmin, QMAX=spec.qmax, SYM=zero_point is None,
                              SCALE_GRAD=need_scale_grad, BLOCK_N=BLOCK_N, BLOCK_K=block_k, **_LAUNCH)
    return grad_w, grad_s


def _act(x: torch.Tensor, fake: bool) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty_like(x2) if fake else torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(m,)](x2, out, scale, k, FAKE=fake,
                                BLOCK_K=min(triton.next_power_of_2(k), 1024), **_LAUNCH)
    return out.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


def quantize_act(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    return _act(x, fake=False)


def fake_quant_act(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return _act(x, fake=True)[0]
