"""The quantized-serving tests (and under AVX2, where W8A8 serves, the KL gate and promotion) again
under every other vLLM CPU kernel build this machine can run: an AVX-512 machine loads `_C_AVX512`
and `_C_AVX2` in every process of a child pytest (rollout.capabilities.kernel_build_env), so the
AVX2 path is tested without an AVX2 machine. The session's own build is the main run; a build
the CPU cannot run is skipped, with the reason. Each child's summary reaches the report as a
warning line (visible in CI's output)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rollout.capabilities import BUILDS, detect, kernel_build_env, machine_isas

REPO = Path(__file__).resolve().parents[1]
QUANTIZED_SERVING = [
    "tests/kernels/test_serving_parity.py::test_act_quant_matches_vllm_cpu_kernel",
    "tests/pipelines/test_quantize.py::test_vllm_serves_the_fake_quant_function",
    "tests/rollout/server/test_quantized_serving.py",
]
# W8A8 there (no W4A16 kernel): the gate's twins, its engine check, the second-engine promotion,
# canary and rollback, and exact speculative sampling on a W8A8 target. test_promote.py's other
# tests (damage refused before any forward, the stack regate, the swap's NaN refusal) do not
# depend on the format and run in the main session only (~60 s of CI saved)
PROMOTE = "tests/rollout/server/test_promote.py::"
AVX2_ALSO = ["tests/pipelines/test_gate.py",
             PROMOTE + "test_good_candidate_is_promoted_and_rollback_restores_it_exactly",
             PROMOTE + "test_a_canary_that_disagrees_with_the_gate_swaps_back",
             "tests/rollout/test_speculative_exactness.py::test_quantized_target_with_its_traffic_draft_samples_exactly"]


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_quantized_serving_under_another_kernel_build(isa):
    caps = detect()
    build = BUILDS[isa]
    if caps.device != "cpu":
        pytest.skip("vLLM runs on CUDA here: no CPU kernel builds to switch")
    if caps.kernel_build == build:
        pytest.skip(f"{build} is this machine's own build: the main run tests it")
    if isa not in machine_isas():
        pytest.skip(f"this CPU cannot run vLLM's {build} kernels (no {isa.upper()})")
    env = {**os.environ, **kernel_build_env(isa)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--timeout=900", *QUANTIZED_SERVING,
           *(AVX2_ALSO if isa == "avx2" else [])]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    warnings.warn(f"quantized serving under {build} (forced {isa}): {summary.strip('= ')}"
                  + "".join(f"\n  {s}" for s in skips))
    assert r.returncode == 0, out[-8000:]
    assert " passed" in summary and "failed" not in summary, summary
    # the child really ran that build (it says so in its own skip reasons or passes)
    probe = subprocess.run([sys.executable, "-c", "from rollout.capabilities import detect; print(detect().kernel_build)"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip().splitlines()[-1] == build, probe.stdout + probe.stderr
