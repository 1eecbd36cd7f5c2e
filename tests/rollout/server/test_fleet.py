"""Two `loop serve` replicas of the tiny model on loopback behind a real vllm-router
(consistent_hash on X-Session-ID): every turn of every episode on one replica and one version,
one trace table read as one dataset, and a replica SIGKILLed under load (its in-flight requests
fail cleanly and are retried on the survivor, new episodes go to the survivor, nothing completed
is lost once the replica restarts and adopts its WAL)."""

from __future__ import annotations

import signal
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
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
               overrides=[f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}", "serve.quant=none",
                          f"serve.weights_roots=[{tempfile.gettempdir()},{REPO / '.cache'}]", "serve.drain_timeout_s=30"],
               episode_idle_s=10.0) as f:
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
    """SIGKILL r1 mid-collection and mid-streams: its in-flight requests fail and are retried on
    the survivor (by the router, else by the collector), a stream it was sending ends with an SSE
    error event (the client abandons or retries that turn), no episode is lost, new episodes go to the survivor, an
    episode that moved keeps one version, and the restarted r1 brings back every trace it had
    committed (its WAL, adopted)."""
    out, streams, stop = {}, Counter(), threading.Event()
    worker = threading.Thread(target=lambda: out.update(r=_collect(fleet, tiny_tokenizer, "kill", 96, seed=5)))
    before = {e for e in _episodes(read_traces(fleet.servers[0].trace_root).to_pylist(), "kill")}
    assert not before
    streamers = [threading.Thread(target=_stream_until, args=(fleet, f"ks{j}", stop, streams)) for j in range(3)]
    for t in [worker, *streamers]:
        t.start()
    time.sleep(4)  # mid-load
    victim = fleet.servers[1]
    victim.stop(sig=signal.SIGKILL)
    worker.join(600)
    stop.set()
    for t in streamers:
        t.join(120)
    # a stream cut off by the kill ends cleanly: an SSE error event naming the failure, never a
    # truncated or hung response; the others complete
    print(f"streams under the kill: {dict(streams)}")
    assert streams["ok"] > 10 and set(streams) <= {"ok", "error event", "http 502", "http 503"}, streams
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


def _stream_until(fleet, run: str, stop: threading.Event, outcomes: Counter) -> None:
    """Streaming completions (64 tokens) until `stop`; each outcome counted: "ok" ([DONE]), "error
    event" (the stream ended with an SSE error event), "http N" (a JSON error), "broken" (anything else)."""
    i = 0
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            i += 1
            try:
                with c.stream("POST", fleet.url + "/v1/completions", headers={"x-session-id": f"{run}-{i}"},
                              json={"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 64, "stream": True,
                                    "temperature": 1.0, "ignore_eos": True}) as r:
                    body = "".join(r.iter_text())
                if r.status_code != 200:
                    outcomes[f"http {r.status_code}"] += 1
                elif body.rstrip().endswith("data: [DONE]"):
                    outcomes["ok"] += 1
                elif '"error"' in body.rstrip().rsplit("\n", 1)[-1] and "mid-response" in body:
                    outcomes["error event"] += 1
                else:
                    outcomes["broken"] += 1
            except httpx.HTTPError as e:
                outcomes[f"broken: {type(e).__name__}"] += 1


class Load:
    """Episodes (the collector) and streaming completions against the fleet until stopped."""

    def __init__(self, fleet, tokenizer, run: str):
        self.fleet, self.tok, self.run, self.stop_at = fleet, tokenizer, run, None
        self.results, self.streams, self.stream_failures = [], 0, []
        self.threads = [threading.Thread(target=self._episodes), threading.Thread(target=self._streams)]

    def __enter__(self):
        self._stop = threading.Event()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self.threads:
            t.join(600)

    def _episodes(self):
        seed = 0
        while not self._stop.is_set():
            seed += 1
            results, stats = _collect(self.fleet, self.tok, f"{self.run}-{seed}-", 8, seed=1000 + seed)
            self.results += [(r, stats) for r in results]

    def _streams(self):
        i = 0
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                i += 1
                try:
                    with c.stream("POST", self.fleet.url + "/v1/completions", headers={"x-session-id": f"{self.run}-s{i}"},
                                  json={"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True,
                                        "temperature": 1.0}) as r:
                        body = "".join(r.iter_text())
                    if r.status_code != 200 or "[DONE]" not in body:
                        self.stream_failures.append(f"{r.status_code} {body[-200:]}")
                    self.streams += 1
                except httpx.HTTPError as e:
                    self.stream_failures.append(repr(e))

    def failed(self) -> list[str]:
        return [r.error or r.status for r, _ in self.results if r.status != "ok"] + self.stream_failures

    def retries(self) -> int:
        return sum({id(s): s.retries for _, s in self.results}.values())


def uniform_copy(src, dst: Path) -> Path:
    """A broken policy: the base with its final norm zeroed, so every logit is 0 (uniform sampling)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from srv_util import write_test_manifest

    dst.mkdir(parents=True)
    for p in Path(src).iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "flywheel_manifest.json":
            shutil.copy(p, dst / p.name)
    for shard in Path(src).glob("*.safetensors"):
        t = load_file(shard)
        t["model.norm.weight"].zero_()
        save_file(t, dst / shard.name, metadata={"format": "pt"})
    write_test_manifest(dst)
    return dst


def _versions_of(fleet, run: str) -> dict[str, set[int]]:
    fleet.flush()
    return {e: {t["weight_version"] for t in ts}
            for e, ts in _episodes(read_traces(fleet.servers[0].trace_root).to_pylist(), run).items()}


def test_a_canary_rolls_out_under_load_and_a_worse_one_rolls_back(fleet, tiny_tokenizer, tiny_base, tmp_path, caplog):
    """Canary (1 of 2 replicas, half the new episodes), then promotion replica by replica, under
    episode and streaming load: no failed request, every episode on one version, both versions
    traced while the canary serves; then a worse canary (weights that sample uniformly) fails the live
    check on its own traffic and is rolled back, again with no failed request."""
    import logging

    from srv_util import perturbed_copy

    from rollout.artifacts import checkpoint_sha256

    caplog.set_level(logging.INFO, logger="flywheel.collector")
    from rollout.server.canary_check import compare_versions

    good, bad = perturbed_copy(tiny_base.path, tmp_path / "good", scale=0.005), uniform_copy(tiny_base.path, tmp_path / "bad")
    stable_v = fleet.servers[0].admin("GET", "/admin/status").json()["weight_version"]
    with Load(fleet, tiny_tokenizer, "roll") as load:
        time.sleep(3)
        since = datetime.now(timezone.utc)  # both versions judged on the same window of traffic
        assert fleet.canary(str(good), checkpoint_sha256(good), fraction=0.5) == [1]
        canary_v = fleet.servers[1].admin("GET", "/admin/status").json()["weight_version"]
        time.sleep(20)
        fleet.flush()
        check = compare_versions(fleet.servers[0].trace_root, stable=stable_v, canary=canary_v, since=since)
        print(check.summary())
        assert check.passed and check.canary.episodes > 10
        fleet.promote()
        time.sleep(5)
    retried = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrying")]
    assert not load.failed() and load.retries() == 0, (load.failed()[:5], load.retries(), retried[:5])
    assert load.streams > 10
    status = [s.admin("GET", "/admin/status").json() for s in fleet.servers]
    assert {s["weight_version"] for s in status} == {canary_v} and canary_v > stable_v  # one number, one checkpoint
    versions = _versions_of(fleet, "roll")
    assert all(len(v) == 1 for v in versions.values()), {e: v for e, v in versions.items() if len(v) > 1}
    assert Counter(next(iter(v)) for v in versions.values()).keys() == {stable_v, canary_v}

    # one dataset holds episodes of both versions, each row with its own version's behaviour logprobs
    import numpy as np
    import pyarrow.parquet as pq

    from pipelines.traces_to_dataset import DatasetConfig, build_dataset

    m = build_dataset(DatasetConfig(trace_root=fleet.servers[0].trace_root, out_dir=tmp_path / "ds",
                                    tokenizer=str(tiny_base.path), heldout_fraction=0.0,
                                    logprobs_mode="processed_logprobs"))
    rows = {r["episode_id"]: r for f in m.files_of("train") for r in pq.read_table(f).to_pylist()}
    played = [ep for ep, _ in load.results if ep.status == "ok"]
    seen = set()
    for ep in played:
        row = rows[ep.episode_id]
        mask, lps, vs = np.zeros(len(row["input_ids"]), np.int8), np.zeros(len(row["input_ids"]), np.float32), None
        for t in ep.turns:
            s = len(t.prompt_ids)
            mask[s:s + len(t.token_ids)], lps[s:s + len(t.token_ids)] = 1, t.logprobs
            vs = t.weight_version
        assert row["behaviour_logprobs"] == lps.tolist() and row["assistant_mask"] == mask.tolist()
        assert {v for v, k in zip(row["weight_versions"], mask) if k} == {vs} == {row["weight_version"]}
        seen.add(vs)
    assert seen == {stable_v, canary_v}

    with Load(fleet, tiny_tokenizer, "bad") as load:
        time.sleep(2)
        since = datetime.now(timezone.utc)
        fleet.canary(str(bad), checkpoint_sha256(bad), fraction=0.5)
        bad_v = fleet.servers[1].admin("GET", "/admin/status").json()["weight_version"]
        time.sleep(25)
        fleet.flush()
        check = compare_versions(fleet.servers[0].trace_root, stable=canary_v, canary=bad_v, since=since)
        print(check.summary())
        assert not check.passed and check.canary.episodes > 10
        fleet.rollback()
        time.sleep(3)
    assert not load.failed() and load.retries() == 0, (load.failed()[:5], load.retries())
    after = [s.admin("GET", "/admin/status").json() for s in fleet.servers]
    assert {(a["checkpoint_sha256"], a["weight_version"]) for a in after} == {(checkpoint_sha256(good), canary_v)}
    mixed = {e: v for e, v in _versions_of(fleet, "bad").items() if len(v) > 1}
    assert not mixed, mixed


def test_the_router_restarted_under_load_keeps_every_episode_on_its_replica(fleet, tiny_tokenizer):
    """The stable router stopped and started mid-load: requests in the gap fail cleanly (502 from
    the splitter, retried by the client), and every episode resumes on its replica by hash."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=_collect(fleet, tiny_tokenizer, "rr", 64, seed=11)))
    worker.start()
    time.sleep(3)
    fleet.router.restart()
    worker.join(600)
    results, stats = out["r"]
    assert stats.episodes_ok == stats.episodes == 256, Counter(r.error for r in results if r.error)
    episodes = _episodes(read_traces(fleet.servers[0].trace_root).to_pylist(), "rr") if not fleet.flush() else {}
    assert len(episodes) == 256
    assert all(len({t["replica"] for t in ts}) == 1 for ts in episodes.values())
    print(f"router restarted under load: client retries {stats.retries}, {stats.seconds:.1f} s")


def test_the_loop_promotes_into_the_fleet_through_its_admin_api(fleet, tiny_tokenizer, tiny_base, tmp_path):
    """The loop's own admin client (pipelines.promote.AdminClient) on the fleet's front door: a
    swap rolls the whole fleet version by version under load (no failed request, every episode on
    one version), a wrong `expected_current_sha` is a 409 that moves nothing, a checkpoint a
    replica refuses is a 409 that leaves serving as it was, and a canary judged on live traffic
    (promote.canary_seconds) with no evidence is rolled back."""
    from srv_util import perturbed_copy

    from pipelines.promote import AdminClient
    from rollout.artifacts import checkpoint_sha256

    admin = AdminClient(fleet.url, fleet.admin_token)
    assert AdminClient(fleet.url, "wrong").swap(str(tiny_base.path))[0] == 403
    before = admin.status()
    assert before["fleet"] and len(before["replicas"]) == 2
    nxt = perturbed_copy(tiny_base.path, tmp_path / "next", scale=0.005, seed=5)
    code, body = admin.swap(str(nxt), sha=checkpoint_sha256(nxt), expected_current_sha="0" * 64)
    assert code == 409 and "expected" in body["error"]["message"]
    assert admin.status()["checkpoint_sha256"] == before["checkpoint_sha256"]

    with Load(fleet, tiny_tokenizer, "adm") as load:
        time.sleep(3)
        code, body = admin.swap(str(nxt), sha=checkpoint_sha256(nxt), expected_current_sha=before["checkpoint_sha256"])
        time.sleep(3)
    assert code == 200, body
    assert {(r["checkpoint_sha256"], r["weight_version"]) for r in admin.status()["replicas"]} == {
        (checkpoint_sha256(nxt), body["weight_version"])} and body["weight_version"] > before["weight_version"]
    assert not load.failed() and load.retries() == 0, (load.failed()[:5], load.retries())
    assert all(len(v) == 1 for v in _versions_of(fleet, "adm").values())

    broken = perturbed_copy(tiny_base.path, tmp_path / "broken", seed=6)
    shard = next(broken.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)  # no longer the bytes its manifest lists
    code, body = admin.swap(str(broken))
    assert code == 409 and "canary refused" in body["error"]["message"], body
    after = admin.status()
    assert {(r["checkpoint_sha256"], r["group"]) for r in after["replicas"]} == {(checkpoint_sha256(nxt), "stable")}

    # the loop's promote.canary_* keys: judged on 3 s of live traffic, of which there is none here,
    # the canary has no evidence of being not worse: rolled back, serving as it was
    from pipelines.promote import PromoteConfig

    judged = PromoteConfig(canary_seconds=3, canary_fraction=0.5).fleet_canary()
    other = perturbed_copy(tiny_base.path, tmp_path / "other", scale=0.005, seed=7)
    code, body = admin.swap(str(other), sha=checkpoint_sha256(other), canary=judged)
    assert code == 409 and "canary rolled back" in body["error"]["message"], body
    assert {(r["checkpoint_sha256"], r["group"]) for r in admin.status()["replicas"]} == {(checkpoint_sha256(nxt), "stable")}
