"""Runs at the start of every Python process whose PYTHONPATH holds this folder (put there, with
FLYWHEEL_VLLM_CPU_KERNELS, by `rollout.capabilities.kernel_build_env`; vLLM's spawned engine core
and workers inherit both). It makes torch's CPU ISA checks answer as a CPU without AVX-512
("avx2") or without AVX-512 BF16 ("avx512"): vLLM's CPU platform reads exactly these to choose
its kernel library (`_C_AVX2`, `_C_AVX512`, `_C`) and its attention paths, so an AVX-512 machine
runs the build an older CPU would. Nothing happens unless the variable names a build.
"""

import os
import sys

_BUILD = os.environ.get("FLYWHEEL_VLLM_CPU_KERNELS", "")


def _patch(cpu) -> None:
    no = lambda: False  # noqa: E731
    cpu._is_avx512_bf16_supported = no
    cpu._is_amx_tile_supported = no  # no such CPU has AMX
    cpu._is_amx_fp16_supported = no
    if _BUILD == "avx2":
        cpu._is_avx512_supported = no
        cpu._is_avx512_vnni_supported = no


class _TorchCpuHook:
    """A meta-path finder that patches `torch.cpu` right after torch executes it (torch itself is
    not imported here: most processes never need it)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch.cpu":
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        sys.meta_path.remove(self)
        return spec


if _BUILD in ("avx2", "avx512"):
    sys.meta_path.insert(0, _TorchCpuHook())
