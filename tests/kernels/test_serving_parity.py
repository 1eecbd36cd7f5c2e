"""The torch twins against the code that writes and serves checkpoints: compressed-tensors 0.17's
qparams, quantize, dequantize and compressors (bit for bit), and vLLM's CPU dynamic per-token int8
activation quantization (bit for bit). The Triton twins equal the torch twins (test_parity.py)."""

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from kernels import QuantSpec, ct_format
from kernels import reference as ref

SPECS = [QuantSpec.w4a16(32), QuantSpec.w4a16(32, symmetric=False),
         QuantSpec.w4a16(None, symmetric=False), QuantSpec.w8a8()]


def _ct_args(spec: QuantSpec) -> QuantizationArgs:
    return QuantizationArgs(num_bits=spec.weight_bits, symmetric=spec.symmetric, type="int",
                            strategy=spec.granularity, group_size=spec.group_size)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-g{s.group_size}")
def test_matches_compressed_tensors(spec, kq_weight, kq_bits):
    w = kq_weight(23, 128, spec.group_len(128), seed=5, qmax=spec.qmax + 0.5)
    args = _ct_args(spec)
    groups = w.reshape(23, -1, spec.group_len(128))
    ct_scale, ct_zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)

    scale, zp = ref.weight_qparams(w, spec)
    assert torch.equal(kq_bits(scale), kq_bits(ct_scale))
    if spec.symmetric:
        assert zp is None and not ct_zp.any()
    else:
        assert torch.equal(zp, ct_zp)

    ct_zp = None if spec.symmetric else ct_zp
    q = ref.quantize(w, scale, zp, spec)
    assert torch.equal(q, ct_quantize(w, ct_scale, ct_zp, args, dtype=torch.int8))
    d = ref.dequantize(q, scale, zp, spec, torch.float32)
    assert torch.equal(kq_bits(d), kq_bits(ct_dequantize(q, ct_scale, ct_zp, args)))

    # The per-layer checkpoint tensors equal what compressed-tensors' own compressor writes.
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=(
        QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
        if spec.activations != "none" else None))
    compressor = BaseCompressor.get_value_from_registry(spec.format)
    state = {"weight": w, "weight_scale": ct_scale} | ({} if ct_zp is None else {"weight_zero_point": ct_zp})
    theirs = compressor.compress(state, scheme)
    ours = ct_format.to_compressed(q, scale, zp, spec)
    assert sorted(theirs) == sorted(ours)
    for name in ours:
        assert theirs[name].dtype == ours[name].dtype and torch.equal(theirs[name], ours[name]), name
    q2, s2, z2 = ct_format.from_compressed(ours, spec)
    assert torch.equal(q2, q) and torch.equal(s2, scale) and (z2 is None or torch.equal(z2, zp))


def test_int4_packing_odd_sizes():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (13, 29), dtype=torch.int8)
    assert torch.equal(ct_format.pack_int4(q), pack_to_int32(q, 4))
    assert torch.equal(ct_format.unpack_int4(ct_format.pack_int4(q), 29), q)
    assert torch.equal(ct_format.pack_int4(q.t().contiguous()).t(), pack_to_int32(q, 4, packed_dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_matches_vllm_cpu_kernel(dtype):
    """Bit for bit against the kernel build this process loaded, as that build does it: _C_AVX2
    writes -128 for an all-zero row (its scale is 0, so it still dequantizes to 0)."""
    ops = pytest.importorskip("vllm._custom_ops")
    from rollout.capabilities import detect

    caps = detect()
    if caps.device != "cpu":
        pytest.skip("vLLM's CPU int8 kernel: this process runs vLLM on CUDA")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(512, 384, generator=g) * torch.rand(512, 1, generator=g) * 10
    x[0] = 0.0
    x[1] = 0.25
    x[2, 3] = 1e6
    x[3] = torch.randn(384, generator=g) * 1e-30
    x[4] = 1e-39                                   # subnormal scale: 1 / scale overflows to inf
    x[4, 0] = -3e-39
    x = x.to(dtype)
    q_vllm, s_vllm, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    q, s = ref.quantize_act(x, QuantSpec.w8a8())
    assert torch.equal(s, s_vllm)
    want = torch.where(s == 0, caps.int8_zero_row, q).to(torch.int8)
    assert torch.equal(want, q_vllm), f"{caps.kernel_build}: {(want != q_vllm).sum()} of {q.numel()} differ"
    assert torch.equal(q.float() * s, q_vllm.float() * s_vllm)  # what the GEMM sees: equal on every build
