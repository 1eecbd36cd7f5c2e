"""Benchmark the quantization kernels: Triton versus their torch twins, side by side in one run.

    python bench/kernels.py [--n 4096 --k 4096 --m 16 --group 128 --dtype bfloat16 --iters 20]

On a GPU: checks Triton against torch on the device first (bit-exact where the math is integer,
else max |diff|), then times both with CUDA events and prints achieved bandwidth next to the
device's measured copy bandwidth (a large tensor copy, read + write). On the CPU there is no
Triton backend (the interpreter is for parity tests only), so it times the torch twins alone with
perf_counter, says so, and reports them against the CPU's measured copy bandwidth; the
fake-quant forward+backward row is the QAT training path's cost.
Bytes counted per op are the compulsory traffic (inputs read once, outputs written once).

    python bench/kernels.py --ptx 90

needs no GPU: it compiles every Triton kernel for that CUDA arch (ptxas ships with triton) and
counts, per kernel, the PTX instructions that decide rounding parity with torch: IEEE
`div.rn.f32` (wanted) against approximate `div.full.f32` / `div.approx`, and `fma.rn.f32`
contractions (none wanted in the quantization kernels).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

# Run as a script, this file's folder comes first on sys.path and its name shadows the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

from kernels import QuantSpec, ct_format, ops  # noqa: E402


def _timer(device: torch.device, fn, iters: int) -> float:
    """Median seconds per call after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """GB/s of a 256 MiB device-to-device copy (read + write)."""
    x = torch.empty(64 << 20, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _timer(device, lambda: y.copy_(x), iters) / 1e9


def _cases(spec: QuantSpec, n: int, k: int, m: int, dtype: torch.dtype, device: torch.device):
    """-> [(name, bytes moved, {impl: callable})] for one spec."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, generator=g, device=device).to(dtype).requires_grad_()
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    b = w.element_size()
    scale, zp = ops.weight_qparams(w, spec, impl="torch")
    q = ops.quantize(w, scale, zp, spec, impl="torch")
    grad = torch.ones_like(w)
    nk, mk = n * k, m * k

    def fq_fwd_bwd(impl):
        ops.fake_quant(w, scale, zp, spec, impl=impl).backward(grad)
        w.grad = None

    cases = [
        ("weight_qparams", nk * b, lambda i: ops.weight_qparams(w, spec, impl=i)),
        ("quantize", nk * (b + 1), lambda i: ops.quantize(w, scale, zp, spec, impl=i)),
        ("dequantize", nk * (1 + b), lambda i: ops.dequantize(q, scale, zp, spec, dtype=dtype, impl=i)),
        ("fake_quant fwd+bwd", nk * (4 * b + 2), fq_fwd_bwd),
    ]
    if spec.weight_bits == 8:
        x_q, x_s = ops.quantize_act(x, spec, impl="torch")
        cases += [
            ("quantize_act", mk * (b + 1), lambda i: ops.quantize_act(x, spec, impl=i)),
            ("fake_quant_act", mk * 2 * b, lambda i: ops.fake_quant_act(x, spec, impl=i)),
            ("int8_matmul", mk + nk + m * n * b,
             lambda i: ops.int8_matmul(x_q, x_s, q, scale, spec, out_dtype=dtype, impl=i)),
        ]
    else:
        t = ct_format.to_compressed(q, scale, zp, spec)
        packed, zpp = t["weight_packed"], t.get("weight_zero_point")
        cases.append(("w4a16_matmul", mk * b + nk // 2 + scale.numel() * b + m * n * b,
                      lambda i: ops.w4a16_matmul(x, packed, scale, zpp, spec, impl=i)))
    return [(name, nbytes, {impl: (lambda fn=fn, impl=impl: fn(impl)) for impl in ("torch", "triton")})
            for name, nbytes, fn in cases]


def _parity(spec: QuantSpec, device: torch.device, dtype: torch.dtype) -> None:
    w = torch.randn(333, 512, device=device).to(dtype)
    out = {}
    for impl in ("torch", "triton"):
        s, z = ops.weight_qparams(w, spec, impl=impl)
        q = ops.quantize(w, s, z, spec, impl=impl)
        out[impl] = (s, q, ops.fake_quant(w, s, z, spec, impl=impl))
    same = [torch.equal(a, b) for a, b in zip(out["torch"], out["triton"])]
    print(f"  parity on {device.type} ({spec.name}): scales/q/fake_quant bit-exact = {same}")


def ptx_check(arch: int) -> None:
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.triton_matmul as tm
    import kernels.triton_quant as tq

    dims = {"N": "i32", "K": "i32", "G": "i32", "NG": "i32"}
    q = {"QMIN": -8, "QMAX": 7, "SYM": False, "BLOCK_N": 16, "BLOCK_K": 128}
    kernels = [
        (tq._qparams_kernel, {"w_ptr": "*bf16", "scale_ptr": "*bf16", "zp_ptr": "*i8"} | dims, q | {"EPS": 2 ** -7}),
        (tq._quant_kernel, {"w_ptr": "*bf16", "scale_ptr": "*bf16", "zp_ptr": "*i8", "out_ptr": "*bf16",
                            "mask_ptr": "*i1"} | dims, q | {"FAKE": True}),
        (tq._dequant_kernel, {"q_ptr": "*i8", "scale_ptr": "*bf16", "zp_ptr": "*i8", "out_ptr": "*bf16"} | dims,
         {"SYM": False, "BLOCK_N": 16, "BLOCK_K": 128}),
        (tq._fq_backward_kernel, {"grad_ptr": "*fp32", "w_ptr": "*fp32", "scale_ptr": "*fp32", "zp_ptr": "*i8",
                                  "mask_ptr": "*i1", "gw_ptr": "*fp32", "gs_ptr": "*fp32"} | dims,
         q | {"SCALE_GRAD": True}),
        (tq._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "K": "i32"},
         {"FAKE": False, "BLOCK_K": 1024}),
        (tm._int8_mm_kernel, {"x_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*bf16",
                              "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}, {"BM": 32, "BN": 64, "BK": 64}),
        (tm._w4a16_kernel, {"x_ptr": "*bf16", "wp_ptr": "*i32", "s_ptr": "*bf16", "zp_ptr": "*i32",
                            "out_ptr": "*bf16", "M": "i32", "KP": "i32"} | dims,
         {"SYM": False, "IEEE": False, "UPCAST": False, "BM": 32, "BN": 64, "BK": 64}),
    ]
    print(f"PTX for sm_{arch}: {'kernel':<22}{'div.rn':>8}{'div.full':>10}{'div.approx':>12}{'fma.rn':>8}")
    for fn, sig, consts in kernels:
        src = ASTSource(fn=fn, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        counts = [len(re.findall(re.escape(p), ptx)) for p in ("div.rn.f32", "div.full.f32", "div.approx", "fma.rn.f32")]
        print(f"{'':<14}{fn.__name__:<22}" + "".join(f"{c:>{w}}" for c, w in zip(counts, (8, 10, 12, 8))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=16, help="tokens for the activation ops and matmuls")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--iters", type=int, default=None, help="default: 50 on CUDA, 5 on CPU")
    parser.add_argument("--ptx", type=int, default=None, metavar="ARCH",
                        help="only compile the Triton kernels for sm_ARCH (no GPU needed) and count rounding ops")
    args = parser.parse_args()
    if args.ptx:
        return ptx_check(args.ptx)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    iters = args.iters or (50 if device.type == "cuda" else 5)
    impls = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; weight {args.n}x{args.k} {dtype}, m={args.m}")
    if device.type != "cuda":
        print("no GPU: timing the torch twins only (Triton runs on the CPU only in the interpreter)")
    bw = copy_bandwidth(device, iters)
    print(f"measured copy bandwidth: {bw:.1f} GB/s")

    for spec in (QuantSpec.w4a16(args.group), QuantSpec.w8a8()):
        print(f"\n{spec.name} (group {spec.group_size})")
        if device.type == "cuda":
            _parity(spec, device, dtype)
        print(f"  {'op':<20}" + "".join(f"{i + ' ms':>12}{i + ' GB/s':>13}{'% copy':>8}" for i in impls)
              + ("   triton/torch" if len(impls) == 2 else ""))
        for op, nbytes, fns in _cases(spec, args.n, args.k, args.m, dtype, device):
            secs = {i: _timer(device, fns[i], iters) for i in impls}
            row = "".join(f"{secs[i] * 1e3:>12.3f}{nbytes / secs[i] / 1e9:>13.1f}"
                          f"{100 * nbytes / secs[i] / 1e9 / bw:>7.0f}%" for i in impls)
            ratio = f"{secs['torch'] / secs['triton']:>14.2f}x" if len(impls) == 2 else ""
            print(f"  {op:<20}{row}{ratio}")


if __name__ == "__main__":
    main()
