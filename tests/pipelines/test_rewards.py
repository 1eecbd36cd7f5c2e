"""Reward functions are plain functions of an episode's logged tokens; feedback combines by mode."""

from __future__ import annotations

import doctest
from datetime import datetime, timedelta, timezone

import pytest

import pipelines.rewards as rewards
from pipelines.rewards import EpisodeRecord, combine, load_fn, score, task_ground_truth, task_reward
from rollout.chat import ChatFormat
from rollout.tasks.calculator import TASK, TOOLS, demonstration, make_problems
from rollout.traces import Feedback

T0 = datetime(2026, 12, 2, tzinfo=timezone.utc)


def _record(tok, messages, feedback=(), rating_range=(-1, 1)) -> EpisodeRecord:
    ids = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False)
    return EpisodeRecord("e", ("t",), list(ids), lambda x: tok.decode(x, skip_special_tokens=False), tuple(feedback),
                         rating_range, ChatFormat.of(tok, TASK.tools), TASK)


def test_task_reward_on_rendered_demonstrations(tiny_tokenizer):
    for p in make_problems("eval", 5, seed=3):
        demo = demonstration(p)
        assert task_reward(_record(tiny_tokenizer, demo)) == 1.0
        assert task_ground_truth(_record(tiny_tokenizer, demo)) == str(p.answer)
        wrong = demo[:-1] + [{"role": "assistant", "content": f"Answer: {p.answer + 1}"}]
        assert task_reward(_record(tiny_tokenizer, wrong)) == 0.0
        assert task_reward(_record(tiny_tokenizer, demo[:2] + [demo[-1]])) == 0.0  # no calculator call
    off_task = [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "No."}]
    assert task_reward(_record(tiny_tokenizer, off_task)) is None


def test_shaped_reward_credits_the_tool_call_format(tiny_tokenizer):
    from pipelines.rewards import shaped_task_reward

    p = make_problems("eval", 1, seed=4)[0]
    demo = demonstration(p)
    wrong = demo[:-1] + [{"role": "assistant", "content": f"Answer: {p.answer + 1}"}]
    assert shaped_task_reward(_record(tiny_tokenizer, demo)) == 1.0
    assert shaped_task_reward(_record(tiny_tokenizer, wrong)) == 0.2
    assert shaped_task_reward(_record(tiny_tokenizer, demo[:2] + [demo[-1]])) == 0.0  # no calculator call
    assert shaped_task_reward(_record(tiny_tokenizer, [{"role": "user", "content": "Hi"}])) is None


def test_feedback_modes_and_latest_feedback_wins(tiny_tokenizer):
    p = make_problems("eval", 1)[0]
    fb = [Feedback(trace_id="t", reward=0.0, created_at=T0), Feedback(trace_id="t", rating=1, created_at=T0),
          Feedback(trace_id="t", reward=0.5, created_at=T0 + timedelta(seconds=1)),
          Feedback(trace_id="t", rating=-1, created_at=T0 + timedelta(seconds=2))]
    # the latest row: a thumbs-down rating counts as 0 (dataset.rating_range [-1, 1])
    assert _record(tiny_tokenizer, demonstration(p), fb).feedback_reward == 0.0
    # on a 1..5 star scale -1 is no rating at all: the latest row with a reward
    ep = _record(tiny_tokenizer, demonstration(p), fb, rating_range=(1, 5))
    assert ep.feedback_reward == 0.5
    assert score(ep, task_reward, "ignore") == 1.0
    assert score(ep, task_reward, "override") == 0.5
    assert score(ep, task_reward, "mean") == 0.75
    calls = []
    assert score(ep, lambda e: calls.append(e) or 1.0, "override") == 0.5 and calls == []  # not evaluated
    assert score(_record(tiny_tokenizer, demonstration(p)), rewards.feedback_reward, "mean") is None
    with pytest.raises(ValueError, match="feedback mode"):
        combine(1.0, None, "max")


def test_load_fn_takes_module_colon_function():
    assert load_fn("pipelines.rewards:task_reward") is task_reward
    for bad in ("pipelines.rewards", ":task_reward", "pipelines.rewards:DEFAULT_REWARD_FN"):
        with pytest.raises(ValueError):
            load_fn(bad)
    with pytest.raises(ImportError):
        load_fn("no_such_module_xyz:f")


def test_doctests():
    assert doctest.testmod(rewards).failed == 0
