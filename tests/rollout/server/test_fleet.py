"""Two `loop serve` replicas of the tiny model on loopback behind a real vllm-router
(consistent_hash on X-Session-ID): every turn of every episode on one replica and one version,
one trace table read as one dataset, and a replica SIGKILLed under load (its in-flight requests
fail cleanly and are retried on the survivor, new episodes go to the survivor, nothing completed
is lost once the replica restarts and adopts its WAL)."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from rollout.collector import CollectorConfig, collect_sync
from rollout.tasks.calculator import TASK, make_problems
from rollout.traces import read_traces

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def fleet(tiny_base, tiny_cfg, tmp_path_factory):
    from rollout.server.fleet import Fleet

    root = tmp_path_factory.mktemp("fleet")
    with Fleet(REPO / "conf" / "tiny.yaml", tiny_base.path, root / "data", root / "logs", replicas=2,
               overrides=[f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}", "serve.quant=none"]) as f:
        yield f


def _episodes(rows: list[dict], run: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        if (r["episode_id"] or "").startswith(run):
            out.setdefault(r["episode_id"], []).append(r)
    return out


def _collect(fleet, tokenizer, run: str, n: int, seed: int):
    cfg = CollectorConfig(base_url=fleet.url, group_size=4, concurrency=8, temperature=1.0, max_tokens=48,
                          progress=False, run_id=run, max_retries=8, retry_backoff_s=0.5)
    return collect_sync(make_problems("train", n, seed=seed), tokenizer, cfg, TASK)


def test_every_turn_of_an_episode_on_one_replica_and_one_version_read_as_one_dataset(fleet, tiny_tokenizer,
                                                                                  tiny_base, tmp_path):
    from pipelines.traces_to_dataset import DatasetConfig, build_dataset

    results, stats = _collect(fleet, tiny_tokenizer, "one", 12, seed=3)
    assert stats.episodes_ok == 48, [r.error for r in results]
    fleet.flush()
    rows = read_traces(fleet.servers[0].trace_root).to_pylist()
    episodes = _episodes(rows, "one")
    assert len(episodes) == 48 and sum(len(e) for e in episodes.values()) == sum(len(r.turns) for r in results)
    assert any(len(e) > 1 for e in episodes.values()), "the tiny model should call the calculator"
    for turns in episodes.values():
        assert len({(t["replica"], t["writer_id"], t["weight_version"]) for t in turns}) == 1, turns
    per_replica = Counter(turns[0]["replica"] for turns in episodes.values())
    assert set(per_replica) == {"r0", "r1"}, per_replica  # the hash spreads episodes over both
    # one version number for the one checkpoint both replicas serve
    assert len({t["weight_version"] for t in rows}) == 1
    assert len({t["writer_id"] for t in rows}) == 2

    m = build_dataset(DatasetConfig(trace_root=fleet.servers[0].trace_root, out_dir=tmp_path / "ds",
                                    tokenizer=str(tiny_base.path), heldout_fraction=0.0,
                                    logprobs_mode="processed_logprobs"))
    assert m.train_episodes == 48 and m.dropped_rows["duplicate_trace"] == 0


def test_a_replica_killed_under_load(fleet, tiny_tokenizer):
    """SIGKILL r1 mid-collection: its in-flight requests fail and are retried on the survivor (by
    the router, else by the collector), no episode is lost, new episodes go to the survivor, an
    episode that moved keeps one version, and the restarted r1 brings back every trace it had
    committed (its WAL, adopted)."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=_collect(fleet, tiny_tokenizer, "kill", 96, seed=5)))
    before = {e for e in _episodes(read_traces(fleet.servers[0].trace_root).to_pylist(), "kill")}
    assert not before
    worker.start()
    time.sleep(4)  # mid-load
    victim = fleet.servers[1]
    victim.stop(sig=signal.SIGKILL)
    worker.join(600)
    results, stats = out["r"]
    assert stats.episodes_ok == stats.episodes == 384, Counter(r.error for r in results if r.error)
    assert stats.seconds > 6, "the load ended before the kill"

    # new episodes went to the survivor: the last ones all ran on r0
    fleet.restart(1)
    fleet.flush()
    episodes = _episodes(read_traces(fleet.servers[0].trace_root).to_pylist(), "kill")
    by_start = sorted(episodes.values(), key=lambda ts: min(t["created_at"] for t in ts))
    assert {t["replica"] for ts in by_start[:40] for t in ts} == {"r0", "r1"}  # both served before the kill
    assert {t["replica"] for ts in by_start[-40:] for t in ts} == {"r0"}
    # nothing completed is lost: every turn the client finished is a trace with its id
    done = {t.trace_id for r in results for t in r.turns}
    have = {t["trace_id"] for ts in episodes.values() for t in ts}
    assert done <= have, f"{len(done - have)} completed turns lost"
    moved = [ts for ts in episodes.values() if len({t["replica"] for t in ts}) > 1]
    for ts in moved:  # moved off the killed replica, on the same version
        assert [t["replica"] for t in sorted(ts, key=lambda t: t["created_at"])][-1] == "r0"
        assert len({t["weight_version"] for t in ts}) == 1
    print(f"killed r1 under load: {len(moved)} episodes moved to r0, client retries {stats.retries}")
    assert httpx.get(fleet.url + "/v1/models", timeout=10).status_code == 200


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


def httpx_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
