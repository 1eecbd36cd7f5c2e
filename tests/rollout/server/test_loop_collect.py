"""The loop's collect and build_dataset phases against a server the loop did not start
(`collect.endpoint`): the episodes go through it, the loop flushes it with the admin token, and
every collected episode is in the dataset with the rewards it was given."""

from __future__ import annotations

import pyarrow.parquet as pq
from srv_util import ADMIN_TOKEN


def test_collect_through_an_existing_endpoint_then_build(srv_main, tiny_base, tmp_path, monkeypatch):
    from loop.collect import collect_phase, dataset_phase, endpoint
    from loop.config import load_config

    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", ADMIN_TOKEN)  # the token comes from the environment only
    cfg = load_config("conf/tiny.yaml", [
        f"run_dir={tmp_path / 'run'}", f"serve.trace_root={srv_main.trace_root}",
        f"collect.endpoint={srv_main.url}", "collect.num_problems=2", "collect.rollout.group_size=3", "collect.rollout.max_tokens=32",
        "dataset.heldout_fraction=0"])
    with endpoint(cfg, tiny_base.path, tmp_path / "run") as ep:
        assert ep.process is None and ep.url == srv_main.url
        collected = collect_phase(cfg, ep, tiny_base.path)
    assert (collected.episodes, collected.episodes_ok, collected.endpoint) == (6, 6, srv_main.url)
    assert collected.weight_versions and len(collected.group_successes) == 2

    dataset = dataset_phase(cfg, collected, str(tiny_base.path), tmp_path / "run")
    rows = [r for f in dataset.files_of("train") for r in pq.read_table(f, columns=["episode_id", "reward"]).to_pylist()
            if r["episode_id"].startswith(collected.run_id + "-")]  # the server's other traffic is in the window too
    assert sorted(r["episode_id"] for r in rows) == [f"{collected.run_id}-{g}-{s}" for g in range(2) for s in range(3)]
    # conf/tiny.yaml scores with the shaped reward (1 right answer, 0.2 the tool call alone), not the
    # collector's exact-reward feedback: the right answers are still the collector's successes
    assert sum(r["reward"] == 1.0 for r in rows) == sum(collected.group_successes)
    assert {r["reward"] for r in rows} <= {0.0, 0.2, 1.0}
    assert dataset.heldout_episodes == 0 and dataset.parent.weight_versions == collected.weight_versions
