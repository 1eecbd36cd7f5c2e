"""Triton twins of the low-bit matmuls in reference.py: int8 x int8 -> int32 with scales, and
W4A16 with the int4 dequant fused into the matmul.

int8_matmul: acc = x_q @ w_q^T accumulated in int32 (exact), then (float(acc) * x_scale) * w_scale
in that order, so it is bit-exact with the torch twin. w4a16_matmul reads the compressed-tensors
`pack-quantized` tensors as stored (ct_format.py): each [BLOCK_K, BLOCK_N] weight tile is
unpacked from its int32 words, dequantized as (q - z) * s in float32, cast to the activation dtype
and fed to tl.dot (float32 inputs use IEEE precision, not TF32); accumulation order differs from
torch's GEMM, so its parity is to a tolerance. Launches pass enable_fp_fusion=False.
Interpreter deviation: Triton's interpreter multiplies bfloat16 dot operands as raw uint16 bits,
so under TRITON_INTERPRET=1 half-precision tiles are upcast to float32 before tl.dot (products of
bf16 values are exact in float32, as in the GPU's bf16 dot with float32 accumulation).
"""

import torch
import triton
import triton.language as tl

from kernels.spec import QuantSpec
from kernels.triton_quant import _cast

_LAUNCH = {"enable_fp_fusion": False}
INTERPRETED = triton.knobs.runtime.interpret  # as `triton.jit` saw it when decorating below


@triton.jit
def _int8_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
        b = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0).to(tl.float32)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * xs[:, None]
    out = out * ws[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], _cast(out, out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _w4a16_kernel(x_ptr, wp_ptr, s_ptr, zp_ptr, out_ptr, M, N, K, G, NG, KP,
                  SYM: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        xm = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=xm, other=0.0)
        wm = (rk[:, None] < K) & (rn[None, :] < N)
        word = tl.load(wp_ptr + rn[None, :] * KP + rk[:, None] // 8, mask=wm, other=0)
        q = ((word >> ((rk[:, None] % 8) * 4).to(tl.int32)) & 0xF).to(tl.float32) - 8.0
        grp = rk[:, None] // G
        s = tl.load(s_ptr + rn[None, :] * NG + grp, mask=wm, other=0.0).to(tl.float32)
        if not SYM:
            zw = tl.load(zp_ptr + (rn[None, :] // 8) * NG + grp, mask=wm, other=0)
            q = q - (((zw >> ((rn[None, :] % 8) * 4).to(tl.int32)) & 0xF).to(tl.float32) - 8.0)
        w = _cast(q * s, x_ptr.dtype.element_ty)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], _cast(acc, out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def int8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    x_q, w_q = x_q.contiguous(), w_q.contiguous()
    (m, k), n = x_q.shape, w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    bm, bn, bk = 32, 64, 64
    _int8_mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x_q, x_scale.contiguous(), w_q, w_scale.contiguous(), out, m, n, k, BM=bm, BN=bn, BK=bk, **_LAUNCH)
    return out


def w4a16_matmul(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor,
                 zero_point: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    x, w_packed, scale = x.contiguous(), w_packed.contiguous(), scale.contiguous()
    (m, k), n = x.shape, w_packed.shape[0]
    g = spec.group_len(k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = 32, 64, 64
    zp = scale if zero_point is None else zero_point.contiguous()
    _w4a16_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w_packed, scale, zp, out, m, n, k, g, k // g, w_packed.shape[1],
        SYM=zero_point is None, IEEE=x.dtype == torch.float32,
        UPCAST=INTERPRETED and x.dtype != torch.float32,
        BM=bm, BN=bn, BK=bk, **_LAUNCH)
    return out
