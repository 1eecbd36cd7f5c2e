"""Quantized serving on the vLLM kernel build this process loads (tests/test_kernel_builds.py runs
this file again under every older build the CPU can run). `serve.quant` picks the format (`auto`:
the best this build serves) and the server quantizes the float32 base itself; the format and the
kernel build show in the trace's stack, /metrics, /admin/status and the start-up log; W4A16
hot-swaps in place, W8A8 through a second engine; a format the build cannot serve is a config
error before any engine starts. One engine per format (two for the W8A8 swap)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from srv_util import REPO, ServerProc, chat_messages, perturbed_copy, placement, sse_events

from rollout.capabilities import detect

pytestmark = pytest.mark.slow
BODY = {"model": "flywheel", "messages": chat_messages(), "max_tokens": 16, "temperature": 0}


def _serve_base(fmt, tiny_base, tmp_path_factory):
    """`loop serve` on the float32 base with the format asked as a user would: `auto` when it is
    this build's best, else by name. Yields (server, the format's spec, a second checkpoint)."""
    from loop.serving import serving_spec
    from pipelines.quantize import quantize_checkpoint

    caps = detect()
    if not caps.can_serve(fmt):
        pytest.skip(caps.why_not(fmt))
    root = tmp_path_factory.mktemp(f"srv_{fmt}")
    quant = "auto" if caps.formats[0] == fmt else fmt
    spec = serving_spec(fmt, 32, "bfloat16")
    q2 = quantize_checkpoint(perturbed_copy(tiny_base.path, root / "fp2"), root / "q2", spec).path
    server = ServerProc(tiny_base.path, root / "data", root / "server.log",
                        [f"serve.quant={quant}", f"bootstrap.cache_dir={root / 'cache'}"]).wait_healthy()
    return server, q2


@pytest.fixture(scope="module")
def srv_w4a16(tiny_base, tmp_path_factory):
    server, q2 = _serve_base("w4a16", tiny_base, tmp_path_factory)
    yield server, q2, tiny_base.path
    server.stop()


@pytest.fixture(scope="module")
def srv_w8a8(tiny_base, tmp_path_factory):
    server, q2 = _serve_base("w8a8", tiny_base, tmp_path_factory)
    yield server, q2
    server.stop()


def _says_what_it_serves(server, fmt: str) -> dict:
    caps = detect()
    r = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    row = server.trace(r.headers["x-flywheel-trace-id"])
    assert row["stack"]["quant_format"] == f"compressed-tensors-{fmt}" and row["status"] == "ok"
    assert row["stack"]["kernel_build"] == caps.kernel_build
    assert row["stack"]["w4a16_activations"] == (caps.w4a16_activations if fmt == "w4a16" else None)
    assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
    info = (f'flywheel_serving_info{{device="{caps.device}",dtype="bfloat16",kernel_build="{caps.kernel_build}",'
            f'quant_format="compressed-tensors-{fmt}"}} 1.0')
    assert info in httpx.get(server.url + "/metrics").text
    status = server.admin("GET", "/admin/status").json()
    assert status["stack"]["kernel_build"] == caps.kernel_build
    assert f"kernels {caps.kernel_build}" in server.log_tail(400) and f"as {fmt} in bfloat16" in server.log_tail(400)
    return row


def test_w4a16_serves_and_hot_swaps_in_place(srv_w4a16):
    server, q2, full_precision = srv_w4a16
    row = _says_what_it_serves(server, "w4a16")

    swap = server.admin("POST", "/admin/weights", json={"path": q2})
    assert swap.status_code == 200, swap.text
    print(f"\n{detect().kernel_build} W4A16 in-place swap: canary mean |Δ logprob| "
          f"{swap.json()['canary_mean_abs_dlogprob']:.4f}, pause {swap.json()['pause_s']:.3f} s")
    assert swap.json()["weight_version"] == 1
    assert swap.json()["canary_mean_abs_dlogprob"] < detect().canary_tolerance("w4a16")
    r2 = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=60)
    assert r2.headers["x-flywheel-weight-version"] == "1"
    row2 = server.trace(r2.headers["x-flywheel-trace-id"])
    assert row2["weight_version"] == 1 and row2["checkpoint_sha256"] != row["checkpoint_sha256"]
    assert row2["completion_logprobs"] != row["completion_logprobs"]  # other weights

    # A full-precision folder cannot replace W4A16 layers in place.
    bad = server.admin("POST", "/admin/weights", json={"path": full_precision})
    assert bad.status_code == 409 and "quantization format" in bad.json()["error"]["message"]


def test_w8a8_serves_and_swaps_through_a_second_engine_under_load(srv_w8a8):
    from srv_util import StreamingLoad

    server, q2 = srv_w8a8
    _says_what_it_serves(server, "w8a8")
    with StreamingLoad(server.url, n=3) as load:
        r = server.admin("POST", "/admin/weights", json={"path": q2}, timeout=300)
        time.sleep(2)
    assert r.status_code == 200, r.text
    swap = r.json()
    print(f"\n{detect().kernel_build} W8A8 second-engine swap: canary mean |Δ logprob| "
          f"{swap['canary_mean_abs_dlogprob']:.4f}, pause {swap['pause_s']:.3f} s, load {swap['load_s']:.1f} s")
    assert swap["weight_version"] == 1 and swap["canary_mean_abs_dlogprob"] < detect().canary_tolerance("w8a8")
    assert swap["pause_s"] < swap["load_s"]  # the new engine started while the old one served
    failed = [x for x in load.results if x[0] != 200 or not x[3] or any("error" in e for e in sse_events(x[4]))]
    assert not failed and {v for _, _, v, _, _ in load.results} == {0, 1}, failed[:2]
    body = {"model": "flywheel", "messages": chat_messages(), "max_tokens": 8, "temperature": 0}
    after = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert after.status_code == 200 and after.headers["x-flywheel-weight-version"] == "1"
    row = server.trace(after.headers["x-flywheel-trace-id"])
    assert row["stack"]["quant_format"] == "compressed-tensors-w8a8" and row["weight_version"] == 1
    assert row["stack"]["kernel_build"] == detect().kernel_build
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    assert "vllm:num_requests_running" in text and 'flywheel_weight_swaps_total{outcome="ok"} 1.0' in text

    # the second engine's worker took the workers' cores and its engine core the front end's
    # (it was spawned from the pinned API server: rollout.cpu_placement.spawning_engine)
    worker_cpus, engine_cores = placement(server.proc.pid)
    front = os.sched_getaffinity(server.proc.pid)
    assert len(engine_cores) == 1, [open(f"/proc/{p}/stat").read()[:60] for p in engine_cores]  # the first retired
    assert not worker_cpus or (not front & worker_cpus and os.sched_getaffinity(engine_cores[0]) == front)


def test_a_format_this_build_cannot_serve_is_a_config_error(tiny_base, tmp_path):
    caps = detect()
    missing = [f for f in ("w4a16", "w8a8") if not caps.can_serve(f)]
    if not missing:
        pytest.skip(f"vLLM's {caps.kernel_build} serves every format (the refusal runs under _C_AVX2)")
    fmt = missing[0]
    r = subprocess.run([sys.executable, "-m", "loop.cli", "serve", str(REPO / "conf" / "tiny.yaml"),
                        f"serve.model={tiny_base.path}", f"serve.quant={fmt}", f"serve.trace_root={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config error" in r.stderr and f"serve.quant: {fmt} cannot be served" in r.stderr, r.stderr[-2000:]
    assert caps.kernel_build in r.stderr
