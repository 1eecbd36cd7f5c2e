"""QuantizedLinear: a linear layer holding exactly the tensors a compressed-tensors checkpoint
stores for it (ct_format.py), whose forward is the served computation.

Its buffers carry the checkpoint names (`weight_packed`, `weight_scale`, `weight_shape`,
`weight_zero_point` for W4A16; `weight` int8 and `weight_scale` for W8A8), so a converted
model's state_dict is the checkpoint. Forward: W4A16 -> w4a16_matmul (int4 dequant fused);
W8A8 -> dynamic per-token int8 activations, int8 x int8 -> int32 matmul, scales; bias added after.
"""

import torch
from torch import nn

from kernels import ct_format, ops
from kernels.spec import QuantSpec


def compress_weight(weight: torch.Tensor, spec: QuantSpec, impl: str | None = None
                    ) -> dict[str, torch.Tensor]:
    """weight [N, K] float -> its checkpoint tensors by local name (scales from the weight)."""
    w = weight.detach()
    scale, zp = ops.weight_qparams(w, spec, impl=impl)
    return ct_format.to_compressed(ops.quantize(w, scale, zp, spec, impl=impl), scale, zp, spec)


class QuantizedLinear(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, spec: QuantSpec,
                 in_features: int, out_features: int, impl: str | None = None):
        super().__init__()
        self.spec, self.impl = spec, impl
        self.in_features, self.out_features = in_features, out_features
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, spec: QuantSpec,
                   impl: str | None = None) -> "QuantizedLinear":
        """weight [N, K] float -> the layer quantized with `spec` (scales from the weight)."""
        n, k = weight.shape
        return cls(compress_weight(weight, spec, impl), bias, spec, k, n, impl)

    def compressed_tensors(self) -> dict[str, torch.Tensor]:
        return {n: b for n, b in self.named_buffers(recurse=False)}

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        q, scale, zp = ct_format.from_compressed(self.compressed_tensors(), self.spec)
        return ops.dequantize(q, scale, zp, self.spec, dtype=dtype, impl=self.impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.spec.weight_bits == 8:
            x_q, x_s = ops.quantize_act(x2, self.spec, impl=self.impl)
            y = ops.int8_matmul(x_q, x_s, self.weight, self.weight_scale, self.spec,
                                out_dtype=x.dtype, impl=self.impl)
        else:
            y = ops.w4a16_matmul(x2, self.weight_packed, self.weight_scale,
                                 getattr(self, "weight_zero_point", None), self.spec, impl=self.impl)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, spec={self.spec.name}"
