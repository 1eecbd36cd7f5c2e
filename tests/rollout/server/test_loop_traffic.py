"""`collect.source: traffic`: the loop plays nothing. It waits for episodes other clients sent
(each prompt once, thumbs up or down posted to /v1/feedback), skips the cycle honestly when too
few arrive in time, and otherwise builds its dataset from exactly that window; singletons train
under `adv_estimator: auto` (REINFORCE++)."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
import pytest
from srv_util import ADMIN_TOKEN, chat_messages


def _cfg(srv_main, tmp_path, monkeypatch):
    from loop.config import load_config

    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", ADMIN_TOKEN)
    return load_config("conf/tiny.yaml", [
        f"run_dir={tmp_path / 'run'}", f"serve.trace_root={srv_main.trace_root}", f"collect.endpoint={srv_main.url}",
        "collect.source=traffic", "collect.min_episodes=4", "collect.max_wait_s=1.0", "collect.poll_s=0.5",
        "dataset.heldout_fraction=0", "dataset.reward_fn=pipelines.rewards:feedback_reward"])


def _user_episode(url: str, i: int) -> str:
    """An outside agent's one-turn episode under its own id (no `<run>-<problem>-<sample>` naming)."""
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "flywheel", "messages": chat_messages(f"A crate holds {i + 3} jars. How many jars are in {i + 2} crates?"),
        "max_tokens": 24, "temperature": 1.0, "logprobs": True, "episode_id": f"user-session-{i}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-flywheel-trace-id"]


def test_traffic_mode_waits_skips_then_trains_on_ungrouped_feedback(srv_main, tiny_base, tmp_path, monkeypatch):
    from loop.collect import NoTraffic, dataset_phase, endpoint, traffic_phase
    from trainers.rl.data import check_dataset, load_episodes

    cfg = _cfg(srv_main, tmp_path, monkeypatch)
    version = srv_main.admin("GET", "/admin/status").json()["weight_version"]
    since = datetime.now(timezone.utc).isoformat()
    with endpoint(cfg, tiny_base.path, tmp_path / "run") as ep:
        t0 = datetime.now(timezone.utc)
        with pytest.raises(NoTraffic, match=r"0 of collect.min_episodes 4 .* collect.max_wait_s 1s: cycle skipped"):
            traffic_phase(cfg, ep, str(tiny_base.path), version, since)
        assert (datetime.now(timezone.utc) - t0).total_seconds() >= 1.0  # it waited
        traces = [_user_episode(srv_main.url, i) for i in range(6)]
        for i, trace_id in enumerate(traces[:5]):  # thumbs up on even, down on odd; the sixth gets none
            r = httpx.post(srv_main.url + "/v1/feedback", json={"trace_id": trace_id, "rating": 1 if i % 2 == 0 else -1})
            assert r.status_code == 200, r.text
        window = traffic_phase(cfg, ep, str(tiny_base.path), version, since)
    assert window.source == "traffic" and window.episodes == 5 and window.success == pytest.approx(3 / 5)
    cfg.collect.max_episodes = 4  # the window ends after the first four rated episodes
    with endpoint(cfg, tiny_base.path, tmp_path / "run") as ep:
        first4 = traffic_phase(cfg, ep, str(tiny_base.path), version, since)
    assert first4.episodes == 4 and first4.success == pytest.approx(2 / 4) and first4.until < window.until  # up, down, up, down
    cfg.collect.max_episodes = None
    with endpoint(cfg, tiny_base.path, tmp_path / "run") as ep:  # the next version's cycle: none of its own yet
        with pytest.raises(NoTraffic, match=rf"0 of .* served by weight version {version + 1} since"):
            traffic_phase(cfg, ep, str(tiny_base.path), version + 1, since)
        cfg.collect.max_staleness = 1  # what the version before served meanwhile counts
        stale = traffic_phase(cfg, ep, str(tiny_base.path), version + 1, since)
    assert stale.episodes == 5 and stale.weight_versions == (version, version + 1)
    dataset = dataset_phase(cfg, window, str(tiny_base.path), tmp_path / "run")
    assert dataset.train_episodes == 5 and dataset.dropped_episodes.get("missing_reward") == 1
    assert dataset.parent.until == window.until and dataset.parent.weight_versions == (version,)
    episodes = load_episodes(check_dataset(dataset.path), "auto")
    assert episodes.estimator == "reinforce_plus_plus" and episodes.counts["singletons"] == 5
    assert sorted(episodes.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0, 1.0]
