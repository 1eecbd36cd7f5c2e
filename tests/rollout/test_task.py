import json

import pytest

from rollout.chat import ChatFormat
from rollout.tasks.calculator import TASK, calculator, demonstration, make_problems, reward


def test_splits_are_seeded_and_disjoint():
    train, again = make_problems("train", 300, seed=3), make_problems("train", 300, seed=3)
    assert train == again
    evals = make_problems("eval", 300, seed=3)
    # the splits partition the texts: no eval problem is a train problem, whatever the seeds
    many_train = {p.question for s in range(5) for p in make_problems("train", 2000, seed=s)}
    assert not many_train & {p.question for s in (3, "gate-0-1", "gate-0-2") for p in make_problems("eval", 300, s)}
    assert make_problems("eval", 50, "gate-0-1") != make_problems("eval", 50, "gate-0-2")  # fresh per seed
    assert all(int(calculator(p.expression)) == p.answer for p in train + evals)


@pytest.mark.parametrize("expr, out", [("37*12+5", "449"), ("(6*4)/3", "8"), ("7/2", "3.5"), ("-3+1", "-2")])
def test_calculator(expr, out):
    assert calculator(expr) == out


@pytest.mark.parametrize("expr", ["__import__('os')", "2**10", "1/0", "a+1", "1;2", "x" * 100, ""])
def test_calculator_rejects(expr):
    with pytest.raises(ValueError):
        calculator(expr)


def test_reward_is_exact():
    p = make_problems("eval", 1)[0]
    demo = demonstration(p)
    assert reward(p, demo) == 1.0
    wrong = demo[:-1] + [{"role": "assistant", "content": f"Answer: {p.answer + 1}"}]
    assert reward(p, wrong) == 0.0
    no_tool = p.messages() + [{"role": "assistant", "content": f"Answer: {p.answer}"}]
    assert reward(p, no_tool) == 0.0
    malformed = [dict(m) for m in demo]
    malformed[2] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": "{expression: 1+1"}}]}
    assert reward(p, malformed) == 0.0
    wrong_tool = [dict(m) for m in demo]
    wrong_tool[2] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": json.dumps({"expression": "1"})}}]}
    assert reward(p, wrong_tool) == 0.0


def test_parse_assistant_hermes_format(tiny_tokenizer):
    """The collector reads a sampled turn with vLLM's own parser for the template (hermes here),
    as the endpoint does for an outside agent: malformed markup is content and no call."""
    chat = ChatFormat.of(tiny_tokenizer, TASK.tools)
    assert chat.parser_name == "hermes"
    msg = chat.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>')
    assert msg["content"] == "" and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"expression": "2+2"}
    assert chat.parse("Answer: 4") == {"role": "assistant", "content": "Answer: 4", "tool_calls": None}
    bad = chat.parse("<tool_call>{nope}</tool_call>")
    assert bad == {"role": "assistant", "content": "<tool_call>{nope}</tool_call>", "tool_calls": None}


def test_problem_from_question_inverts_every_template():
    from rollout.tasks.calculator import TASK, problem_from_question

    for p in make_problems("eval", 400, seed=5):
        q = problem_from_question(p.question)
        assert q is not None and q.answer == p.answer, p
    assert problem_from_question("What is the meaning of life?") is None


def test_chatml_round_trip(tiny_tokenizer):
    from rollout.tasks.calculator import TASK, TOOLS, problem_from_question

    p = make_problems("eval", 1, seed=9)[0]
    demo = demonstration(p)
    msgs = ChatFormat.of(tiny_tokenizer, TASK.tools).messages(tiny_tokenizer.apply_chat_template(demo, tools=TOOLS, tokenize=False))
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[0]["content"] == demo[0]["content"] and msgs[3]["content"] == demo[3]["content"]
    assert reward(problem_from_question(msgs[1]["content"]), msgs) == 1.0
