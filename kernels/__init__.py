"""Quantization kernels shared by QAT, requantize and validation: one QuantSpec, Triton kernels
with torch twins of the same signature, chosen per call by spec and device (ops.impl_for).

No `__version__` here: transformers probes for Hugging Face's `kernels` package by this name.
"""

from kernels.ct_format import from_compressed, to_compressed
from kernels.layers import quant_targets
from kernels.linear import QuantizedLinear, compress_weight
from kernels.ops import (dequantize, fake_quant, fake_quant_act, impl_for, int8_matmul, quantize,
                         quantize_act, w4a16_matmul, weight_qparams)
from kernels.spec import QuantSpec

__all__ = [
    "QuantSpec", "QuantizedLinear", "impl_for", "quant_targets", "weight_qparams", "quantize",
    "dequantize", "fake_quant", "fake_quant_act", "quantize_act", "int8_matmul", "w4a16_matmul",
    "to_compressed", "from_compressed", "compress_weight",
]
