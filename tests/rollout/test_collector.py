"""The collector's protocol and failure handling against a fake endpoint (a real aiohttp server on
localhost whose handler is faked; the tokenizer and task are real). It plays the ideal episode,
token-in/token-out, and injects 503s, 429s, dropped connections, a 400, a stalled request, a
malformed 200, a failed feedback post and one whose reply is lost. The real server is
exercised in tests/rollout/server/test_collector_e2e.py."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiohttp import web

from rollout.chat import ChatFormat
from rollout.collector import CollectorConfig, collect
from rollout.episode import after_turn
from rollout.tasks.calculator import TASK, calculator, make_problems, problem_from_question


class FakeEndpoint:
    """Answers /v1/completions with a problem's ideal turns; checks every prompt extends the last."""

    def __init__(self, tok, faults: dict[tuple[str, int], list[str]]):
        self.tok, self.faults = tok, faults
        self.log: list[dict] = []  # every completions attempt that reached the "engine"
        self.feedback: list[dict] = []  # every reward posted
        self.feedback_posts: list[list[dict]] = []  # the arrays they came in
        self.sent: dict[tuple[str, int], dict] = {}  # (episode, turn) -> the response sent last

    async def __call__(self, request: web.Request) -> web.Response:
        body = await request.json()
        if request.path == "/v1/feedback":  # one array per group: key ("feedback", "<run>-<group>")
            key = ("feedback", body[0]["episode_id"].rsplit("-", 1)[0])
        else:
            key = (body["episode_id"], body["turn"])
        fault = (self.faults.get(key) or [None]).pop(0) if self.faults.get(key) else None
        if request.path == "/v1/feedback" and fault in (None, "accept-then-drop"):
            self.feedback_posts.append(body)
            self.feedback += body
            if fault == "accept-then-drop":  # committed, but the reply is lost: the client retries
                request.transport.close()
                return web.Response()
            return web.json_response({"data": [{"feedback_id": "f", "trace_id": f["trace_id"]} for f in body]})
        if fault == "malformed":  # a 200 that is not a completion
            return web.json_response({"choices": []})
        if fault == "503":
            return web.json_response({"error": "busy"}, status=503)
        if fault == "429":
            return web.json_response({"error": "queue full"}, status=429, headers={"retry-after": "0"})
        if fault == "drop":  # the connection closes with no answer
            request.transport.close()
            return web.Response()
        if fault == "400":
            return web.json_response({"error": "bad"}, status=400)
        if fault == "stall":
            await asyncio.sleep(30)
        assert body["top_p"] == 1.0 and body["top_k"] == 0 and body["logprobs"] == 0 and body["return_token_ids"]
        prompt = body["prompt"]
        if body["turn"] > 0:
            prev = self.sent[(body["episode_id"], body["turn"] - 1)]
            assert prompt[:len(prev["prompt"]) + len(prev["ids"])] == prev["prompt"] + prev["ids"]
        text = self.tok.decode(prompt, skip_special_tokens=False)
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        problem = problem_from_question(question)
        out = (f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{problem.expression}"}}}}\n'
               f"</tool_call><|im_end|>" if body["turn"] == 0 else f"Answer: {problem.answer}<|im_end|>")
        ids = self.tok.encode(out, add_special_tokens=False)
        lps = [-0.01 * (i + 1) for i in range(len(ids))]
        trace_id = uuid.uuid4().hex
        self.sent[key] = {"prompt": prompt, "ids": ids, "lps": lps, "trace_id": trace_id}
        self.log.append({"key": key, "trace_id": trace_id})
        return web.json_response({"choices": [{"index": 0, "text": out, "token_ids": ids, "finish_reason": "stop",
                                               "logprobs": {"token_logprobs": lps}}]},
                                 headers={"x-flywheel-trace-id": trace_id, "x-flywheel-weight-version": "3"})


def _run(tok, faults, **cfg_kw):
    problems = make_problems("train", 2, seed=5)
    fake = FakeEndpoint(tok, faults)

    async def main():
        app = web.Application()
        app.router.add_post("/v1/{route}", fake)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, shutdown_timeout=0.1)
        await site.start()
        port = runner.addresses[0][1]
        cfg = CollectorConfig(base_url=f"http://127.0.0.1:{port}", group_size=3, run_id="r", progress=False,
                              retry_backoff_s=0.0, **cfg_kw)
        try:
            return await collect(problems, tok, cfg, TASK)
        finally:
            await runner.cleanup()

    results, stats = asyncio.run(main())
    return problems, fake, results, stats


def test_episodes_are_token_in_token_out_and_rewarded_once(tiny_tokenizer):
    problems, fake, results, stats = _run(tiny_tokenizer, {})
    assert [r.episode_id for r in results] == [f"r-{g}-{s}" for g in range(2) for s in range(3)]
    assert stats.episodes == stats.episodes_ok == 6 and stats.requests == 12 + 2 and stats.retries == 0
    for r in results:
        assert r.status == "ok" and r.reward == 1.0 and r.problem is problems[r.group]
        t0, t1 = r.turns
        assert t0.prompt_ids == ChatFormat.of(tiny_tokenizer, TASK.tools).prompt(r.problem.messages())
        result = {"role": "tool", "tool_call_id": "call_0", "content": calculator(r.problem.expression)}
        _, more = after_turn(ChatFormat.of(tiny_tokenizer, TASK.tools), r.messages[:3], [result])
        assert t1.prompt_ids == t0.prompt_ids + t0.token_ids + more
        for k, t in enumerate(r.turns):
            sent = fake.sent[(r.episode_id, k)]
            assert (t.token_ids, t.logprobs, t.trace_id, t.weight_version) == (sent["ids"], sent["lps"], sent["trace_id"], 3)
    assert sorted(f["episode_id"] for f in fake.feedback) == sorted(r.episode_id for r in results)
    assert all(f["trace_id"] == fake.sent[(f["episode_id"], 1)]["trace_id"] and f["reward"] == 1.0
               for f in fake.feedback)
    assert sorted(sorted(f["episode_id"] for f in post) for post in fake.feedback_posts) == \
        [[f"r-{g}-{s}" for s in range(3)] for g in range(2)]  # one array per group


def test_retries_keep_the_episode_once_and_continue_from_the_last_attempt(tiny_tokenizer):
    faults = {("r-0-0", 0): ["503", "429"], ("r-0-1", 1): ["drop"], ("r-1-2", 0): ["drop", "503"]}
    _, fake, results, stats = _run(tiny_tokenizer, faults)
    assert stats.episodes_ok == 6 and stats.retries == 5 and stats.requests == 12 + 2 + 5
    assert [t.attempts for t in results[0].turns] == [3, 1] and [t.attempts for t in results[1].turns] == [1, 2]
    assert len(fake.feedback) == 6 and len({f["episode_id"] for f in fake.feedback}) == 6


def test_failures_and_timeouts_abandon_the_episode_without_feedback(tiny_tokenizer):
    faults = {("r-0-0", 0): ["400"], ("r-0-1", 1): ["503"] * 5, ("r-1-0", 1): ["stall"]}
    _, fake, results, stats = _run(tiny_tokenizer, faults, max_retries=2, episode_timeout_s=2.0)
    status = {r.episode_id: r.status for r in results}
    assert status == {"r-0-0": "error", "r-0-1": "error", "r-0-2": "ok", "r-1-0": "timeout", "r-1-1": "ok",
                      "r-1-2": "ok"}
    assert "HTTP 400" in results[0].error and "HTTP 503" in results[1].error
    assert all(r.reward is None for r in results if r.status != "ok")
    rewards = [f for f in fake.feedback if f["source"] != "abandoned"]
    withdrawn = [f for f in fake.feedback if f["source"] == "abandoned"]
    assert {f["episode_id"] for f in rewards} == {"r-0-2", "r-1-1", "r-1-2"}
    # the abandoned ones are withdrawn from training by episode (no reward), whatever was traced
    assert {f["episode_id"] for f in withdrawn} == {"r-0-0", "r-0-1", "r-1-0"}
    assert all("reward" not in f and f["comment"] for f in withdrawn)
    assert stats.episodes_failed == 3 and stats.episodes == 6


def test_a_malformed_reply_abandons_its_episode_only(tiny_tokenizer):
    _, fake, results, stats = _run(tiny_tokenizer, {("r-0-1", 1): ["malformed"]}, max_retries=1)
    assert [r.status for r in results] == ["ok", "error", "ok", "ok", "ok", "ok"]
    assert "malformed reply" in results[1].error and results[1].reward is None
    assert [f["episode_id"] for f in fake.feedback if f["source"] == "abandoned"] == ["r-0-1"]


def test_a_retried_feedback_post_carries_the_same_idempotency_keys(tiny_tokenizer):
    _, fake, results, stats = _run(tiny_tokenizer, {("feedback", "r-0"): ["accept-then-drop"]})
    assert all(r.status == "ok" for r in results) and stats.retries == 1
    first, retry = [p for p in fake.feedback_posts if p[0]["episode_id"].startswith("r-0-")]
    assert [f["feedback_id"] for f in first] == [f["feedback_id"] for f in retry]  # the server keeps one of each
    assert len({f["feedback_id"] for f in fake.feedback}) == 6


def test_a_group_whose_rewards_cannot_be_posted_is_abandoned(tiny_tokenizer):
    faults = {("feedback", "r-1"): ["503"] * 3}  # group 1's array fails past its retries
    _, fake, results, stats = _run(tiny_tokenizer, faults, max_retries=2)
    assert [r.status for r in results] == ["ok"] * 3 + ["error"] * 3
    assert all(r.reward is None and "HTTP 503" in r.error for r in results[3:])
    assert {f["episode_id"] for f in fake.feedback if f["source"] != "abandoned"} == {"r-0-0", "r-0-1", "r-0-2"}
    assert {f["episode_id"] for f in fake.feedback if f["source"] == "abandoned"} == {"r-1-0", "r-1-1", "r-1-2"}
    assert stats.episodes_failed == 3 and stats.requests == 12 + 1 + 3 + 1 and stats.retries == 2


@pytest.mark.parametrize("change, field", [
    (dict(base_url="127.0.0.1:8000"), "base_url"), (dict(group_size=0), "group_size"),
    (dict(temperature=0.0), "temperature"), (dict(max_retries=-1), "max_retries"),
    (dict(episode_timeout_s=0), "episode_timeout_s"), (dict(concurrency=0), "concurrency"),
])
def test_config_names_the_bad_field(change, field):
    with pytest.raises(ValueError, match=field):
        CollectorConfig(**{"base_url": "http://127.0.0.1:1", **change})
