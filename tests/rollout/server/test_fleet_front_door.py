"""The fleet as a user starts it: `loop serve --replicas 2` on one machine, and the front door alone
(`loop serve ... serve.replica_urls=[...]`) over replicas started held elsewhere, as
infra/k8s/serving.yaml deploys it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from rollout.traces import read_traces

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def test_loop_serve_replicas_starts_the_fleet(tiny_base, tiny_cfg, tmp_path):
    """`loop serve --replicas 2`: two replicas behind the router on serve.port; SIGTERM stops all."""
    import subprocess
    import sys

    from rollout.server.process import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "loop.cli", "serve", str(REPO / "conf" / "tiny.yaml"), "--replicas", "2",
                          f"serve.model={tiny_base.path}", f"serve.port={port}", "serve.quant=none",
                          f"serve.trace_root={tmp_path / 'data'}", f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}"],
                         stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and "serving 2 replicas" not in (tmp_path / "serve.log").read_text():
            assert p.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, headers={"x-session-id": "e1"},
                       json={"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200, r.text
        workers = httpx.get(f"http://127.0.0.1:{port}/list_workers", timeout=10).json()["urls"]
        assert len(workers) == 2 and f"http://127.0.0.1:{port}" not in workers
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(120)
    assert p.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert not any(httpx_ok(u) for u in workers), "replicas left running"


def test_a_front_door_over_replicas_started_elsewhere(tiny_base, tiny_cfg, tmp_path):
    """What infra/k8s/serving.yaml runs: replicas started held by someone else (a StatefulSet),
    and `loop serve ... serve.replica_urls=[...]`, the front door alone over them, with an API key.
    The front door releases them on the stable checkpoint; a promotion through its admin API rolls
    both; a replica that restarts (on the model its command names, held) serves nothing until the
    front door has put it back on the fleet's checkpoint; feedback through the front door keeps
    the API key (vllm-router alone would drop it)."""
    import os
    import secrets
    import subprocess
    import sys

    from srv_util import perturbed_copy

    from rollout.artifacts import checkpoint_sha256
    from rollout.cpu_placement import WORKER_SPIN_ENV
    from rollout.server.fleet import core_slices
    from rollout.server.process import ServerProcess, free_port
    from rollout.traces import read_feedback

    token, key, data = secrets.token_hex(8), secrets.token_hex(8), tmp_path / "data"
    env = {"FW_TEST_API_KEY": key}
    common = ["serve.quant=none", f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}", "serve.api_key_env=FW_TEST_API_KEY",
              f"serve.weights_roots=[{tmp_path}]", "serve.drain_timeout_s=30"]

    # pods have cores of their own: here each replica gets one of the two, and its worker does not spin
    # 1 s after each step on it (as `loop serve --replicas` places them; unplaced, a replica's first
    # step after a restart waited for the other to go idle: 120 s and more, measured on a 2-core Xeon)
    binds = core_slices(2)

    def replica(i: int, port: int | None = None) -> ServerProcess:  # what the StatefulSet's pod runs
        pod = {**env, WORKER_SPIN_ENV: "0.001", **({"VLLM_CPU_OMP_THREADS_BIND": binds[i]} if binds[i] else {})}
        return ServerProcess(REPO / "conf" / "tiny.yaml", tiny_base.path, data, tmp_path / f"k{i}.log", env=pod,
                             overrides=[*common, "serve.start_held=true", f"serve.replica=k{i}"], admin_token=token,
                             port=port)

    replicas = [replica(0), replica(1)]
    door, port = None, free_port()
    auth = {"authorization": f"Bearer {key}"}
    try:
        for r in replicas:
            r.wait_healthy()
        held = httpx.post(replicas[0].url + "/v1/completions", headers=auth, timeout=30,
                          json={"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 2})
        assert held.status_code == 503 and "held" in held.text, held.text
        door = subprocess.Popen(
            [sys.executable, "-m", "loop.cli", "serve", str(REPO / "conf" / "tiny.yaml"), *common, f"serve.port={port}",
             f"serve.replica_urls=[{replicas[0].url},{replicas[1].url}]", f"serve.trace_root={data}",
             "serve.episode_idle_s=5"],
            env={**os.environ, **env, "FLYWHEEL_ADMIN_TOKEN": token}, cwd=REPO, start_new_session=True,
            stdout=open(tmp_path / "door.log", "w"), stderr=subprocess.STDOUT)
        url, log = f"http://127.0.0.1:{port}", tmp_path / "door.log"
        deadline = time.time() + 300
        while time.time() < deadline and "serving 2 replicas" not in log.read_text():
            assert door.poll() is None, log.read_text()[-3000:]
            time.sleep(1)

        def complete(ep: str) -> httpx.Response:
            return httpx.post(url + "/v1/completions", headers={**auth, "x-session-id": ep}, timeout=60,
                              json={"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 1.0})

        assert complete("a").status_code == 200
        assert httpx.post(url + "/v1/completions", timeout=30, json={"model": "flywheel", "prompt": [1], "max_tokens": 1}
                          ).status_code == 401
        new = perturbed_copy(tiny_base.path, tmp_path / "new", scale=0.005)
        admin = {"authorization": f"Bearer {token}"}
        r = httpx.post(url + "/admin/weights", headers=admin, timeout=600,
                       json={"path": str(new), "checkpoint_sha256": checkpoint_sha256(new)})
        assert r.status_code == 200, r.text
        v_new = r.json()["weight_version"]

        replicas[1].stop(sig=signal.SIGKILL)  # the pod dies; its supervisor starts it again, held, on the base model
        replicas[1] = replica(1, port=replicas[1].port).wait_healthy()
        deadline = time.time() + 120
        while (st := replicas[1].admin("GET", "/admin/status").json())["held"] and time.time() < deadline:
            assert complete(f"h{time.time()}").status_code == 200  # r0 serves meanwhile
            time.sleep(0.5)
        assert not st["held"] and st["checkpoint_sha256"] == checkpoint_sha256(new), st
        # the router takes k1 back at its next health checks (1 s apart, not at the release): until then r0 serves
        done, deadline = [], time.time() + 60
        while time.time() < deadline:
            done += [complete(f"after-{len(done) + i}") for i in range(8)]
            assert httpx.post(url + "/admin/flush", headers=admin, timeout=60).status_code == 200
            if any(t["replica"] == "k1" and (t["episode_id"] or "").startswith("after")
                   for t in read_traces(data).to_pylist()):
                break
        assert all(r.status_code == 200 for r in done)

        trace = done[0].headers["x-flywheel-trace-id"]
        fb = httpx.post(url + "/v1/feedback", headers=auth, timeout=30,
                        json={"trace_id": trace, "episode_id": "after-0", "reward": 1.0})
        assert fb.status_code == 200, fb.text
        assert httpx.post(url + "/v1/feedback", timeout=30, json={"trace_id": trace, "reward": 1.0}).status_code == 401
        assert httpx.post(url + "/admin/flush", headers=admin, timeout=60).status_code == 200
        rows = [t for t in read_traces(data).to_pylist() if t["status"] == "ok"]
        late = [t for t in rows if (t["episode_id"] or "").startswith(("h", "after"))]  # all after the restart
        assert {t["weight_version"] for t in late} == {v_new}  # none ran on the base weights k1 restarted with
        assert any(t["replica"] == "k1" for t in late), "the restarted replica took traffic once released"
        assert "after-0" in set(read_feedback(data).column("episode_id").to_pylist())
    finally:
        if door is not None:
            door.send_signal(signal.SIGTERM)
            door.wait(120)
        for r in replicas:
            r.stop()
    assert door.returncode == 0, (tmp_path / "door.log").read_text()[-3000:]


def httpx_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
