"""The agent plugin contract against a real server: a user's agent module from a folder outside
the package plays tasks from a JSONL file through the client it is given; every request of an
episode is traced under its one episode id with turns 0..n-1; an agent that raises, hangs, makes
no request or returns garbage gets its episode abandoned with the reason and nothing else lost;
returned rewards reach /v1/feedback and the dataset built from the window holds exactly the ok
episodes, grouped per task."""

from __future__ import annotations

import asyncio
import json
import textwrap
from datetime import datetime, timezone

import pytest

from rollout.task_source import TaskSourceError, load_tasks

AGENT = textwrap.dedent('''
    import asyncio

    SYSTEM = "You are a calculator agent."

    async def ask(client, text, max_tokens=12):
        r = await client.chat.completions.create(model="flywheel", max_tokens=max_tokens, temperature=1.0,
                                                 messages=[{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": text}])
        return r.choices[0].message.content or ""

    async def play(task, client):
        kind = task["kind"]
        if kind == "none":
            return 1.0
        if kind == "hang":
            await asyncio.sleep(600)
        first = await ask(client, task["question"])
        if kind == "two_turns":
            await client.chat.completions.create(model="flywheel", max_tokens=8, temperature=1.0, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]},
                {"role": "assistant", "content": first}, {"role": "user", "content": "Are you sure?"}])
            return 0.5
        if kind == "raise":
            raise RuntimeError("the tool crashed")
        if kind == "garbage":
            return "yes"
        if kind == "later":
            return None
        return float(task["answer"] in first)

    def not_async(task, client):
        return 1.0
''')
KINDS = ["ok", "two_turns", "raise", "hang", "garbage", "later", "none"]


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_agent")
    (root / "my_agent.py").write_text(AGENT)
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "train.jsonl").write_text("".join(json.dumps({"kind": k, "question": f"What is {i} + 2?", "answer": str(i + 2)})
                                               + "\n" for i, k in enumerate(KINDS)))
    return root


def test_the_agent_contract_on_a_real_server(srv_main, tiny_base, user_folder, tmp_path):
    from pipelines.traces_to_dataset import DatasetConfig, build_dataset
    from rollout.agents import AgentRunConfig, load_agent, run_agent

    agent = load_agent(f"{user_folder / 'my_agent.py'}:play")
    tasks = load_tasks(user_folder / "tasks", "train")
    since = datetime.now(timezone.utc).isoformat()
    cfg = AgentRunConfig(base_url=srv_main.url, group_size=2, episode_timeout_s=60.0)
    hang = [i for i, t in enumerate(tasks) if t["kind"] == "hang"]
    episodes = asyncio.run(run_agent(agent, [t for t in tasks if t["kind"] != "hang"], cfg))
    for e in episodes:  # (the hanging agent in a run of its own, with a short timeout)
        e.task += e.task >= hang[0]
    short = AgentRunConfig(base_url=srv_main.url, group_size=2, episode_timeout_s=3.0, run_id=cfg.run_id + "h")
    for e in asyncio.run(run_agent(agent, [tasks[hang[0]]], short)):
        e.task = hang[0]
        episodes.append(e)
    by_kind = {k: [e for e in episodes if tasks[e.task]["kind"] == k] for k in KINDS}
    assert [len(v) for v in by_kind.values()] == [2] * len(KINDS)
    assert all(e.status == "ok" and e.reward in (0.0, 1.0) for e in by_kind["ok"])
    assert all(e.status == "ok" and e.reward == 0.5 and len(e.trace_ids) == 2 for e in by_kind["two_turns"])
    assert all(e.status == "pending" and e.reward is None for e in by_kind["later"])
    reasons = {k: {e.reason for e in by_kind[k]} for k in ("raise", "hang", "garbage", "none")}
    assert reasons == {"raise": {"the agent raised RuntimeError: the tool crashed"},
                       "hang": {"timed out after task.episode_timeout_s 3s"},
                       "garbage": {"the agent returned 'yes', not a finite number or None"},
                       "none": {"the agent made no request through the client it was given"}}
    assert all(e.status == "abandoned" for k in reasons for e in by_kind[k])

    rows = {r["trace_id"]: r for r in srv_main.traces()}
    for e in episodes:  # every request of an episode under its id, turns in order
        assert [(rows[t]["episode_id"], rows[t]["turn"]) for t in e.trace_ids] == [(e.episode_id, n)
                                                                                    for n in range(len(e.trace_ids))]
    assert srv_main.admin("POST", "/admin/flush").status_code == 200
    ds = build_dataset(DatasetConfig(trace_root=srv_main.trace_root, out_dir=tmp_path / "ds", tokenizer=str(tiny_base.path),
                                     since=since, heldout_fraction=0.0, feedback_mode="override",
                                     reward_fn="pipelines.rewards:feedback_reward"))
    import pyarrow.parquet as pq

    kept = {r["episode_id"]: r for f in ds.files_of("train") for r in pq.read_table(f).to_pylist()}
    ours = {k: v for k, v in kept.items() if k.startswith(cfg.run_id)}
    want = {e.episode_id: e.reward for e in episodes if e.status == "ok"}
    assert {k: v["reward"] for k, v in ours.items()} == want
    assert ds.dropped_episodes.get("abandoned", 0) >= 4 and ds.dropped_episodes.get("missing_reward", 0) >= 2
    two = {e.episode_id for e in by_kind["two_turns"]}
    groups = {v["group_id"] for k, v in ours.items() if k in two}
    assert len(groups) == 1  # a task's samples of one round are one group


def test_a_bad_agent_spec_or_tasks_file_is_refused_by_name(user_folder, tmp_path):
    from rollout.agents import load_agent

    with pytest.raises(ValueError, match="not an async function"):
        load_agent(f"{user_folder / 'my_agent.py'}:not_async")
    with pytest.raises(ValueError, match="expected 'module:function'"):
        load_agent("no_colon")
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"split": "train", "q": 1}\n{"split": "train", "q": 2\n')
    with pytest.raises(TaskSourceError, match=rf"{bad}:2: not JSON"):
        load_tasks(bad, "train")
    bad.write_text('{"split": "train"}\n[1, 2]\n')
    with pytest.raises(TaskSourceError, match=rf"{bad}:2: a task is a JSON object, got list"):
        load_tasks(bad, "train")
    with pytest.raises(TaskSourceError, match="no eval.jsonl or eval.parquet"):
        load_tasks(user_folder / "tasks", "eval")


def test_tasks_come_from_jsonl_parquet_and_a_saved_datasetdict(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"split": "train", "q": "a"}, {"split": "eval", "q": "b"}, {"split": "train", "q": "c"}]
    (tmp_path / "one.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["q"] for r in load_tasks(tmp_path / "one.jsonl", "train")] == ["a", "c"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "one.parquet")
    assert [r["q"] for r in load_tasks(tmp_path / "one.parquet", "eval")] == ["b"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"q": "x"}]),
                          "eval": datasets.Dataset.from_list([{"q": "y"}])}).save_to_disk(str(tmp_path / "saved"))
    assert load_tasks(tmp_path / "saved", "eval") == [{"q": "y"}]


def test_the_loop_collects_through_the_users_agent(srv_main, tiny_base, user_folder, tmp_path, monkeypatch):
    """`task.agent` + `task.source` in the config: the collect phase plays fresh train tasks through
    the agent, and the dataset phase builds from that window; a bad agent or tasks file is a config
    error naming the key (and the file and line)."""
    from loop.collect import agent_collect_phase, dataset_phase, endpoint
    from loop.config import load_config
    from loop.configs import ConfigError
    from srv_util import ADMIN_TOKEN

    tasks = user_folder / "good_tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "train.jsonl").write_text("".join(json.dumps({"kind": k, "question": f"What is {i} + 1?", "answer": str(i + 1)})
                                               + "\n" for i, k in enumerate(["ok", "two_turns", "ok"])))
    agent = f"'{user_folder / 'my_agent.py'}:play'"
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", ADMIN_TOKEN)
    cfg = load_config("conf/tiny.yaml", [
        f"run_dir={tmp_path / 'run'}", f"serve.trace_root={srv_main.trace_root}", f"collect.endpoint={srv_main.url}",
        f"task.agent={agent}", f"task.source='{tasks}'", "collect.num_problems=2", "collect.rollout.group_size=2",
        "dataset.heldout_fraction=0", "dataset.min_heldout=0", "dataset.feedback_mode=override"])
    with endpoint(cfg, tiny_base.path, tmp_path / "run") as ep:
        collected = agent_collect_phase(cfg, ep, problem_seed=3)
    assert (collected.source, collected.episodes, collected.episodes_ok) == ("agent", 4, 4) and collected.weight_versions
    dataset = dataset_phase(cfg, collected, str(tiny_base.path), tmp_path / "run")
    assert dataset.train_episodes == 4, (dataset.dropped_rows, dataset.dropped_episodes)  # the agent's rewards

    base = [f"run_dir={tmp_path / 'run2'}", f"task.source='{tasks}'"]
    with pytest.raises(ConfigError, match=r"task.*cannot import 'no_such_module'"):
        load_config("conf/tiny.yaml", [*base, "task.agent=no_such_module:play"])
    (tasks / "train.jsonl").write_text('{"kind": "ok"}\n{"kind": \n')
    with pytest.raises(ConfigError, match=r"task.*train.jsonl:2: not JSON"):
        load_config("conf/tiny.yaml", [*base, f"task.agent={agent}"])
    with pytest.raises(ConfigError, match="agent and source go together"):
        load_config("conf/tiny.yaml", [f"run_dir={tmp_path / 'run3'}", f"task.agent={agent}"])


def test_loop_eval_plays_the_eval_split_through_the_agent(tiny_base, user_folder, tmp_path, capsys):
    """`loop eval CONFIG MODEL task.agent=... task.source=...`: the eval tasks, once each, through
    a server of MODEL; abandoned episodes count 0, later rewards are left out and counted."""
    from loop.cli import main

    tasks = user_folder / "eval_tasks"
    tasks.mkdir(exist_ok=True)
    kinds = ["ok", "ok", "raise", "later", "two_turns"]
    (tasks / "eval.jsonl").write_text("".join(json.dumps({"kind": k, "question": f"What is {i} + 3?", "answer": str(i + 3)})
                                              + "\n" for i, k in enumerate(kinds)))
    (tasks / "train.jsonl").write_text(json.dumps({"kind": "ok", "question": "1 + 1?", "answer": "2"}) + "\n")
    rc = main(["eval", "conf/tiny.yaml", str(tiny_base.path), f"run_dir={tmp_path}", "--json",
               f"task.agent='{user_folder / 'my_agent.py'}:play'", f"task.source='{tasks}'"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["num_problems"], out["abandoned"], out["pending"]) == (5, 1, 1)
    assert len(out["outcomes"]) == 4 and 0.5 in out["outcomes"] and 0.0 in out["outcomes"]
    assert out["success"] == pytest.approx(sum(out["outcomes"]) / 4)
