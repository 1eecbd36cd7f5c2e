"""Triton kernels (interpreter, CPU) against their torch twins on fresh random inputs with edge rows.

Bit-exact wherever the math is integer or a fixed sequence of IEEE float ops; the W4A16 matmul and
the LSQ scale gradient sum in a different order, so they are compared to a stated tolerance.
Every Triton output is poisoned before the run (kq_poisoned), so unwritten elements show.
"""

import pytest
import torch

from kernels import QuantSpec, ct_format
from kernels import reference as ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes divide by 0

tq = pytest.importorskip("kernels.triton_quant")
tm = pytest.importorskip("kernels.triton_matmul")

# (spec, (N, K), dtype): odd sizes, N below and above the row block, a group that is not a power
# of two, per-channel over several column chunks, bf16.
WEIGHT_CASES = [
    (QuantSpec.w4a16(32), (37, 96), torch.float32),
    (QuantSpec.w4a16(6, symmetric=False), (19, 42), torch.float32),
    (QuantSpec.w4a16(None, symmetric=False), (9, 1030), torch.float32),
    (QuantSpec.w4a16(64), (7, 128), torch.bfloat16),
    (QuantSpec.w8a8(), (21, 77), torch.float32),
    (QuantSpec.w8a8(), (5, 300), torch.bfloat16),
    (QuantSpec.w4a16(16, symmetric=False, scale_dtype="bfloat16"), (8, 48), torch.float32),
]


def _case_id(case):
    spec, (n, k), dtype = case
    return f"{spec.name}-g{spec.group_size}-{n}x{k}-{str(dtype)[6:]}-s{spec.scale_dtype}"


@pytest.mark.parametrize("case", WEIGHT_CASES, ids=_case_id)
def test_weight_kernels_bit_exact(case, kq_poisoned, kq_bits, kq_weight):
    spec, (n, k), dtype = case
    w = kq_weight(n, k, spec.group_len(k), dtype, seed=n * k, qmax=spec.qmax + 0.5)

    s_ref, z_ref = ref.weight_qparams(w, spec)
    s, z = kq_poisoned(tq.weight_qparams, w, spec)
    assert torch.equal(kq_bits(s), kq_bits(s_ref))
    assert (z is None) == spec.symmetric and (z is None or torch.equal(z, z_ref))
    assert (s > 0).all()

    q_ref = ref.quantize(w, s_ref, z_ref, spec)
    assert torch.equal(kq_poisoned(tq.quantize, w, s_ref, z_ref, spec), q_ref)
    assert q_ref.min() >= spec.qmin and q_ref.max() <= spec.qmax

    d_ref = ref.dequantize(q_ref, s_ref, z_ref, spec, dtype)
    assert torch.equal(kq_bits(kq_poisoned(tq.dequantize, q_ref, s_ref, z_ref, spec, dtype)), kq_bits(d_ref))

    y_ref, m_ref = ref.fake_quant_forward(w, s_ref, z_ref, spec)
    y, m = kq_poisoned(tq.fake_quant_forward, w, s_ref, z_ref, spec)
    assert torch.equal(kq_bits(y), kq_bits(y_ref)) and torch.equal(m, m_ref)
    # fake-quant is exactly dequantize(quantize(w)), bit for bit.
    assert torch.equal(kq_bits(y_ref), kq_bits(d_ref))

    grad = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    gw_ref, gs_ref = ref.fake_quant_backward(grad, w, s_ref, z_ref, m_ref, spec, True)
    gw, gs = kq_poisoned(tq.fake_quant_backward, grad, w, s_ref, z_ref, m_ref, spec, True)
    assert torch.equal(kq_bits(gw), kq_bits(gw_ref))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    finite = torch.isfinite(gs_ref)
    torch.testing.assert_close(gs[finite].float(), gs_ref[finite].float(), rtol=tol, atol=tol)


def _act_input(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 300, generator=g) * 3
    x[0, 0] = 0.0                                   # zero token
    x[0, 1] = 0.25                                  # all-equal token
    x[0, 2, 7] = 1e6                                # huge outlier
    x[0, 3] = torch.randn(300, generator=g) * 1e-30  # tiny scale
    x[0, 4, ::2] = -0.0                             # +-0 mixed in
    x[1, 0] = (torch.arange(300) % 254 - 127).float() + 0.5  # ties: amax 127 -> scale 1
    x[1, 0, 0] = 127.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_bit_exact(dtype, kq_poisoned, kq_bits):
    spec, x = QuantSpec.w8a8(), _act_input(dtype)
    q_ref, s_ref = ref.quantize_act(x, spec)
    q, s = kq_poisoned(tq.quantize_act, x, spec)
    assert q.shape == x.shape and s.shape == (2, 5, 1)
    assert torch.equal(q, q_ref) and torch.equal(kq_bits(s), kq_bits(s_ref))
    f = kq_poisoned(tq.fake_quant_act, x, spec)
    assert torch.equal(kq_bits(f), kq_bits(ref.fake_quant_act(x, spec)))
    assert q_ref[0, 0].eq(0).all() and q_ref[1, 0, 1:3].tolist() == [-126, -124]  # -125.5, -124.5


@pytest.mark.parametrize("m,n,k,out_dtype", [(13, 45, 77, torch.float32), (1, 5, 300, torch.float32),
                                             (33, 70, 64, torch.bfloat16)])
def test_int8_matmul_bit_exact(m, n, k, out_dtype, kq_poisoned, kq_bits):
    spec = QuantSpec.w8a8()
    g = torch.Generator().manual_seed(m * n * k)
    x = torch.randn(m, k, generator=g)
    x[0, 0] = 1e4
    w = torch.randn(n, k, generator=g)
    w_s, _ = ref.weight_qparams(w, spec)
    w_q = ref.quantize(w, w_s, None, spec)
    x_q, x_s = ref.quantize_act(x, spec)
    out = kq_poisoned(tm.int8_matmul, x_q, x_s, w_q, w_s, out_dtype)
    assert torch.equal(kq_bits(out), kq_bits(ref.int8_matmul(x_q, x_s, w_q, w_s, out_dtype)))
    out_ref = ref.int8_matmul(x_q, x_s, w_q, w_s, torch.float32)
    exact = (x_q.double() @ w_q.double().t()) * x_s.double() * w_s.double().t()
    torch.testing.assert_close(out_ref.double(), exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("spec,m,n,k,dtype", [
    (QuantSpec.w4a16(32), 9, 72, 96, torch.float32),
    (QuantSpec.w4a16(6, symmetric=False), 5, 19, 42, torch.float32),
    (QuantSpec.w4a16(None, symmetric=False), 3, 10, 1030, torch.float32),
    (QuantSpec.w4a16(32, symmetric=False), 17, 40, 64, torch.bfloat16),
], ids=["sym-g32", "asym-g6", "asym-channel", "asym-g32-bf16"])
def test_w4a16_matmul(spec, m, n, k, dtype, kq_poisoned, kq_weight):
    """float32 to 1e-5 (summation order); bfloat16 to one bf16 ulp of the output."""
    w = kq_weight(n, k, spec.group_len(k), dtype, seed=k)
    w[3] = torch.randn(k)  # the 1e30 outlier row would swamp every tolerance
    s, z = ref.weight_qparams(w, spec)
    t = ct_format.to_compressed(ref.quantize(w, s, z, spec), s, z, spec)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    args = (x, t["weight_packed"], s, t.get("weight_zero_point"), spec)
    out_ref = ref.w4a16_matmul(*args)
    out = kq_poisoned(tm.w4a16_matmul, *args)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    dense = x.double() @ ref.dequantize(ref.quantize(w, s, z, spec), s, z, spec, dtype).double().t()
    torch.testing.assert_close(out_ref.double(), dense, rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), dense, rtol=tol, atol=tol)
