"""A W4A16 compressed-tensors folder (the quantize pipeline's output) served, traced with its quant
format, and hot-swapped in place to another W4A16 checkpoint, verified by the canary. One engine."""

from __future__ import annotations

import os

import httpx
import pytest
from srv_util import ServerProc, chat_messages, perturbed_copy, placement

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv_w4a16(tiny_base, tmp_path_factory):
    from kernels import QuantSpec
    from pipelines.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("srv_w4a16")
    spec = QuantSpec(weight_bits=4, group_size=32)
    q1 = quantize_checkpoint(tiny_base.path, root / "q1", spec)
    q2 = quantize_checkpoint(perturbed_copy(tiny_base.path, root / "fp2"), root / "q2", spec)
    # vLLM's CPU W4A16 kernel has no float32 path: the quantized server runs in bfloat16
    server = ServerProc(q1.path, root / "data", root / "server.log", ["engine.dtype=bfloat16"]).wait_healthy()
    try:
        yield server, q1.path, q2.path, tiny_base.path
    finally:
        server.stop()


def test_serves_a_w4a16_folder_and_hot_swaps_it(srv_w4a16):
    server, q1, q2, full_precision = srv_w4a16
    body = {"model": "flywheel", "messages": chat_messages(), "max_tokens": 16, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    row = server.trace(r.headers["x-flywheel-trace-id"])
    assert row["stack"]["quant_format"] == "compressed-tensors-w4a16" and row["status"] == "ok"
    assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0

    swap = server.admin("POST", "/admin/weights", json={"path": q2})
    assert swap.status_code == 200, swap.text
    assert swap.json()["weight_version"] == 1 and swap.json()["canary_mean_abs_dlogprob"] < 0.05
    r2 = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r2.headers["x-flywheel-weight-version"] == "1"
    row2 = server.trace(r2.headers["x-flywheel-trace-id"])
    assert row2["weight_version"] == 1 and row2["checkpoint_sha256"] != row["checkpoint_sha256"]
    assert row2["completion_logprobs"] != row["completion_logprobs"]  # other weights

    # A full-precision folder cannot replace W4A16 layers in place.
    bad = server.admin("POST", "/admin/weights", json={"path": full_precision})
    assert bad.status_code == 409 and "quantization format" in bad.json()["error"]["message"]


@pytest.fixture(scope="module")
def srv_w8a8(tiny_base, tmp_path_factory):
    from kernels import QuantSpec
    from pipelines.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("srv_w8a8")
    spec = QuantSpec(weight_bits=8, symmetric=True, granularity="channel", group_size=None,
                     activations="int8_dynamic_token")
    q1 = quantize_checkpoint(tiny_base.path, root / "q1", spec)
    q2 = quantize_checkpoint(perturbed_copy(tiny_base.path, root / "fp2"), root / "q2", spec)
    server = ServerProc(q1.path, root / "data", root / "server.log", ["engine.dtype=bfloat16"]).wait_healthy()
    try:
        yield server, q1.path, q2.path
    finally:
        server.stop()


def test_w8a8_swaps_through_a_second_engine_under_load(srv_w8a8):
    from test_hot_swap import StreamingLoad
    from srv_util import sse_events

    server, q1, q2 = srv_w8a8
    with StreamingLoad(server.url, n=3) as load:
        r = server.admin("POST", "/admin/weights", json={"path": q2}, timeout=300)
        import time

        time.sleep(2)
    assert r.status_code == 200, r.text
    swap = r.json()
    assert swap["weight_version"] == 1 and swap["canary_mean_abs_dlogprob"] < 0.05
    assert swap["pause_s"] < swap["load_s"]  # the new engine started while the old one served
    failed = [x for x in load.results if x[0] != 200 or not x[3] or any("error" in e for e in sse_events(x[4]))]
    assert not failed and {v for _, _, v, _, _ in load.results} == {0, 1}, failed[:2]
    body = {"model": "flywheel", "messages": chat_messages(), "max_tokens": 8, "temperature": 0}
    after = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert after.status_code == 200 and after.headers["x-flywheel-weight-version"] == "1"
    row = server.trace(after.headers["x-flywheel-trace-id"])
    assert row["stack"]["quant_format"] == "compressed-tensors-w8a8" and row["weight_version"] == 1
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    assert "vllm:num_requests_running" in text and 'flywheel_weight_swaps_total{outcome="ok"} 1.0' in text

    # the second engine's worker took the workers' cores and its engine core the front end's
    # (it was spawned from the pinned API server: rollout.cpu_placement.spawning_engine)
    worker_cpus, engine_cores = placement(server.proc.pid)
    front = os.sched_getaffinity(server.proc.pid)
    assert len(engine_cores) == 1, [open(f"/proc/{p}/stat").read()[:60] for p in engine_cores]  # the first retired
    assert not worker_cpus or (not front & worker_cpus and os.sched_getaffinity(engine_cores[0]) == front)
