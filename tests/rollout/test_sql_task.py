"""The SQL task (rollout/tasks/sql.py) and the task plugin contract (rollout/tasks)."""

import json

import pytest

from rollout.chat import ChatFormat
from rollout.episode import Completion, run_episodes
from rollout.tasks import load_task
from rollout.tasks.sql import TASK, TEMPLATES, demonstration, make_problems, problem_from_question, reward, shop


def test_splits_are_seeded_disjoint_and_answered_by_their_query():
    train = make_problems("train", 500, seed=3)
    assert train == make_problems("train", 500, seed=3)
    evals = {p.question for s in (0, 3, "gate-0-1") for p in make_problems("eval", 200, s)}
    assert not evals & {p.question for s in range(3) for p in make_problems("train", 1000, s)}
    assert {p.question.split(":")[1].split()[1] for p in train} >= {"many", "was"}  # several templates drawn
    for p in train[:100]:
        env = TASK.env(p)
        assert env.call("query", json.dumps({"sql": p.sql})) == str(p.answer)
        assert problem_from_question(p.question).answer == p.answer  # rewards need only the text


def test_every_template_is_recovered_from_its_text():
    seen = set()
    for p in make_problems("train", 300, seed=1):
        words = p.question.split(": ")[1].split()
        seen.add(next(i for i, (text, _) in enumerate(TEMPLATES)
                      if all(w.startswith("{") or w == v for w, v in zip(text.split(": ")[1].split(), words))))
        q = problem_from_question(p.question)
        assert (q.question, q.shop, q.sql, q.answer) == (p.question, p.shop, p.sql, p.answer)
    assert seen == set(range(len(TEMPLATES)))
    assert problem_from_question("A box holds 12 pens. How many pens are in 7 boxes?") is None


def test_the_tools_read_a_per_shop_schema_read_only_and_bounded():
    p = make_problems("eval", 1, seed=5)[0]
    s, env = shop(p.shop), TASK.env(p)
    assert env.call("list_tables", "{}") == ", ".join(sorted(["customers", s.table]))
    assert env.call("describe_table", json.dumps({"table": s.table})) == \
        f"id INTEGER, {s.customer} TEXT, item TEXT, {s.quantity} INTEGER"
    assert env.call("describe_table", json.dumps({"table": "nope"})) == "error: no table named 'nope'"
    assert env.call("query", json.dumps({"sql": f"DELETE FROM {s.table}"})).startswith("error: attempt to write")
    assert env.call("query", json.dumps({"sql": f"SELECT COUNT(*) FROM {s.table}"})) == str(len(s.rows))
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    assert env.call("query", json.dumps({"sql": forever})) == "error: interrupted"
    assert env.call("query", json.dumps({"sql": f"SELECT COUNT(*) FROM {s.table}"})) == str(len(s.rows))  # budget resets
    assert env.call("query", json.dumps({"sql": "SELECT 1" + " " * 400})).startswith("error: a query is at most")
    assert env.call("query", "{sql: 1") == "error: arguments must be a JSON object"
    assert env.call("drop_everything", "{}") == "error: no tool named 'drop_everything'"
    assert TASK.env(p).call("list_tables", "{}") == env.call("list_tables", "{}")  # each episode its own connection


def test_reward_is_exact_and_needs_a_query():
    p = make_problems("eval", 3, seed=2)[2]
    demo = demonstration(p)
    assert [m["role"] for m in demo[2:]] == ["assistant", "tool"] * 3 + ["assistant"]
    assert reward(p, demo) == 1.0
    assert reward(p, demo[:-1] + [{"role": "assistant", "content": f"Answer: {p.answer + 1}"}]) == 0.0
    guessed = p.messages() + [{"role": "assistant", "content": f"Answer: {p.answer}"}]
    assert reward(p, guessed) == 0.0  # the right number, never asked of the database
    looked_only = demo[:6] + [{"role": "assistant", "content": f"Answer: {p.answer}"}]
    assert reward(p, looked_only) == 0.0
    assert reward(p, demo[:-1]) == 0.0  # ended on a tool result, no answer


def test_the_collectors_episode_loop_plays_the_demonstration_token_in_token_out(tiny_tokenizer):
    """A policy that samples exactly the demonstration's turns: four turns through the task's
    environment, each next prompt the last one + the sampled ids + the rendered tool result."""
    problems = make_problems("eval", 4, seed=9)
    chat = ChatFormat.of(tiny_tokenizer, TASK.tools)
    demos = [demonstration(p) for p in problems]
    turn = [0]

    def generate(prompts, temperature, max_tokens):  # every episode is live every turn, in problem order
        k, turn[0] = turn[0], turn[0] + 1
        sampled = []
        for ids, demo in zip(prompts, demos):
            at = [i for i, m in enumerate(demo) if m["role"] == "assistant"][k]
            assert ids == chat.prompt(demo[:at])  # nothing re-tokenized differs from a fresh render here
            sampled.append(Completion(chat.ids(chat.assistant_text(demo[:at + 1]))))
        return sampled

    episodes = run_episodes(problems, tiny_tokenizer, generate, task=TASK, temperature=1.0)
    for ep in episodes:
        demo = demonstration(ep.problem)
        assert ep.reward == 1.0 and len(ep.turns) == 4
        assert [m.get("content") for m in ep.messages] == [m.get("content") for m in demo]
        full = ep.turns[-1].prompt_ids + ep.turns[-1].completion.token_ids
        back = chat.messages(tiny_tokenizer.decode(full, skip_special_tokens=False))
        assert TASK.reward(TASK.problem_of(back[1]["content"]), back) == 1.0  # the dataset build's reading


def test_tasks_load_by_name_or_from_your_module(tmp_path, monkeypatch):
    assert load_task("sql") is TASK and load_task("calculator").name == "calculator"
    (tmp_path / "my_tasks.py").write_text(
        "import dataclasses\nfrom rollout.tasks.calculator import TASK\n"
        "MINE = dataclasses.replace(TASK, name='mine', max_turns=3)\n"
        "HALF = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_task("my_tasks:MINE").max_turns == 3
    with pytest.raises(ValueError, match="lacks name, tools, max_turns"):
        load_task("my_tasks:HALF")
    with pytest.raises(ValueError, match="cannot import"):
        load_task("my_tasks:NOPE")
    with pytest.raises(ValueError, match="a built-in task"):
        load_task("sqlite")
