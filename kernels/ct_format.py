"""The compressed-tensors on-disk tensors of one quantized linear layer, as vLLM 0.32 loads them.

`pack-quantized` (W4A16), names relative to the layer:
  weight_packed      int32 [N, ceil(K / 8)]  q + 8 as 4-bit nibbles, column k in bits 4*(k % 8)
  weight_scale       [N, K // G]             in the model dtype
  weight_shape       int64 [2]               (N, K)
  weight_zero_point  int32 [ceil(N / 8), K // G]  zero point + 8, packed along rows (asym only)
`int-quantized` (W8A8):
  weight             int8 [N, K]
  weight_scale       [N, 1]                  in the model dtype (vLLM reads it as float32)
Symmetric formats store no zero point (compressed-tensors drops it; vLLM would refuse it).
This is what compressed-tensors 0.17's `pack_to_int32` and compressors write; the parity test
checks the packing bit for bit against it.
"""

import torch

from kernels.spec import QuantSpec

_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [R, C] in [-8, 7] -> int32 [R, ceil(C / 8)] (column c at bits 4 * (c % 8))."""
    if q.dtype != torch.int8:
        raise ValueError(f"pack_int4 needs int8 values, got {q.dtype}")
    r, c = q.shape
    u = (q.to(torch.int32) + 8)
    pad = -c % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(r, -1, 8) << _SHIFTS.to(q.device)
    return u.sum(-1, dtype=torch.int32)


def unpack_int4(p: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [R, ceil(cols / 8)] -> int8 [R, cols] in [-8, 7]."""
    if p.dtype != torch.int32:
        raise ValueError(f"unpack_int4 needs int32 words, got {p.dtype}")
    u = (p.unsqueeze(-1) >> _SHIFTS.to(p.device)) & 0xF
    return (u.reshape(p.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def to_compressed(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  spec: QuantSpec) -> dict[str, torch.Tensor]:
    """q int8 [N, K], scale, zero_point (from kernels.quantize) -> the layer's tensors by local name."""
    if spec.weight_bits == 8:
        return {"weight": q.contiguous(), "weight_scale": scale.contiguous()}
    out = {
        "weight_packed": pack_int4(q),
        "weight_scale": scale.contiguous(),
        "weight_shape": torch.tensor(q.shape, dtype=torch.int64),
    }
    if not spec.symmetric:
        out["weight_zero_point"] = pack_int4(zero_point.t().contiguous()).t().contiguous()
    return out


def from_compressed(tensors: dict[str, torch.Tensor], spec: QuantSpec
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of to_compressed -> (q int8 [N, K], scale, zero_point int8 or None)."""
    if spec.weight_bits == 8:
        return tensors["weight"], tensors["weight_scale"], None
    n, k = (int(v) for v in tensors["weight_shape"])
    q = unpack_int4(tensors["weight_packed"], k)
    zp = None
    if not spec.symmetric:
        zp = unpack_int4(tensors["weight_zero_point"].t().contiguous(), n).t().contiguous()
    return q, tensors["weight_scale"], zp
