"""A real agent framework as the client: examples/agents_sdk_calculator.py (the OpenAI Agents SDK,
its own tool loop) played through the plugin runner against a real server. Its tool calls are
parsed by the server (hermes), the SDK runs the tool and sends the result back (multi-turn), every
request of an episode is traced under its one episode id with turns 0..n-1, and turns the
framework re-sent as text that re-tokenize differently from what was sampled are counted, in the
traces and in the dataset's manifest, and kept as segments: every trained token is a sampled one."""

from __future__ import annotations

import asyncio
import inspect
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("agents", reason="the OpenAI Agents SDK (pip install openai-agents: the `examples` extra)")

REPO = Path(__file__).resolve().parents[3]


def extends(prev: dict, nxt: dict) -> bool:
    whole = prev["prompt_token_ids"] + prev["completion_token_ids"]
    return nxt["prompt_token_ids"][:len(whole)] == whole


def test_an_agents_sdk_agent_plays_through_the_endpoint(srv_main, tiny_base, tmp_path):
    from pipelines.traces_to_dataset import DatasetConfig, build_dataset
    from rollout.agents import AgentRunConfig, load_agent, run_agent
    from rollout.tasks.calculator import make_problems
    from rollout.traces import read_traces

    agent = load_agent(f"{REPO / 'examples' / 'agents_sdk_calculator.py'}:play")
    evaluate = inspect.getmodule(agent).evaluate  # its calculator: arithmetic only
    assert (evaluate("38+4*2"), evaluate("(7-9)*3"), evaluate("10/4")) == ("46", "-6", "2.5")
    with pytest.raises(ValueError):
        evaluate("__import__('os')")
    tasks = [{"question": p.question, "answer": p.answer} for p in make_problems("train", 24, seed=5)]
    since = datetime.now(timezone.utc).isoformat()
    run = AgentRunConfig(base_url=srv_main.url, group_size=1, episode_timeout_s=120.0)
    episodes = asyncio.run(run_agent(agent, tasks, run))
    assert all(e.status in ("ok", "abandoned") for e in episodes) and sum(e.status == "ok" for e in episodes) >= 20
    srv_main.flush()
    rows = [r for r in read_traces(srv_main.trace_root, columns=["episode_id", "turn", "status", "created_at",
                                                                "prompt_token_ids", "completion_token_ids"]).to_pylist()
            if (r["episode_id"] or "").startswith(run.run_id)]
    by = defaultdict(dict)  # episode -> turn -> its latest ok attempt (the client retries a 429 as the same turn)
    for r in sorted(rows, key=lambda r: r["created_at"]):
        if r["status"] == "ok":
            by[r["episode_id"]][r["turn"]] = r
    assert set(by) == {e.episode_id for e in episodes}  # every episode traced under its own id
    for eid, turns in by.items():
        assert sorted(turns) == list(range(len(turns))), eid
        by[eid] = [turns[k] for k in sorted(turns)]
    multi = [t for t in by.values() if len(t) > 1]
    assert multi, "no episode called the calculator and went on (the SDK runs the tool, then asks again)"
    # the framework re-sends text: a turn whose prompt does not extend what was sampled before
    misaligned = {eid for eid, t in by.items() if any(not extends(a, b) for a, b in zip(t, t[1:]))}
    print(f"\n{len(by)} episodes, {len(multi)} multi-turn, {len(misaligned)} with a re-tokenized turn")
    m = build_dataset(DatasetConfig(trace_root=Path(srv_main.trace_root), out_dir=tmp_path / "ds",
                                    tokenizer=tiny_base.path, since=since, heldout_fraction=0.0,
                                    feedback_mode="override"))
    ok = {e.episode_id for e in episodes if e.status == "ok"}
    assert not m.dropped_episodes.get("misaligned") and m.split_episodes == len(misaligned & ok)  # counted, kept
    assert not m.dropped_episodes.get("missing_turn")  # retried requests kept their turn
    assert m.train_episodes == len(ok) + m.segment_rows - m.split_episodes  # a row per segment
    for f in m.files_of("train"):
        for row in pq.read_table(f).to_pylist():  # every trained token is one the server sampled and logged
            turns = by[row["episode_id"]]
            mine = [t for t in turns  # the turns this row holds: each one's prompt + completion starts it
                    if row["input_ids"][:len(t["prompt_token_ids"]) + len(t["completion_token_ids"])]
                    == list(t["prompt_token_ids"]) + list(t["completion_token_ids"])]
            assert sum(row["assistant_mask"]) == sum(len(t["completion_token_ids"]) for t in mine) > 0


def test_outside_traffic_from_the_framework_agent_is_rated_not_rewarded(srv_main):
    """examples/outside_traffic.py --agent: the SDK agent plays each problem once through the plugin
    runner's client; the server gets one user thumbs per episode (up exactly where the agent's answer
    was right) and no reward: what `collect.source: traffic` then trains on."""
    import importlib.util

    from rollout.tasks.calculator import make_problems
    from rollout.traces import read_feedback

    spec = importlib.util.spec_from_file_location("outside_traffic", REPO / "examples" / "outside_traffic.py")
    traffic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(traffic)
    problems = make_problems("train", 12, seed=77)
    rows = asyncio.run(traffic.agent_round(srv_main.url, problems, f"{REPO / 'examples' / 'agents_sdk_calculator.py'}:play"))
    assert len(rows) >= 10 and len({e for _, e, _ in rows}) == len(rows)  # one per problem played
    assert asyncio.run(traffic.post_ratings(srv_main.url, rows)) == len(rows)
    srv_main.flush()
    mine = {e: up for _, e, up in rows}
    fb = [r for r in read_feedback(srv_main.trace_root, columns=["episode_id", "rating", "reward", "source"]).to_pylist()
          if r["episode_id"] in mine]
    assert sorted(r["episode_id"] for r in fb) == sorted(mine)  # one row each: the thumbs, no reward row
    assert all(r["source"] == "user" and r["reward"] is None and r["rating"] == (1 if mine[r["episode_id"]] else -1)
               for r in fb)
