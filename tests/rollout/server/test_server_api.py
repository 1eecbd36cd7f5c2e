"""The server through the official openai client and raw HTTP: vLLM's features, one trace row per
request with the exact token ids the client saw, bad input, overload, feedback, metrics."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile

import aiohttp
import httpx
import pytest
from srv_util import ADMIN_TOKEN, assert_sampling_logprobs, chat_messages, sampled_row, sse_events

from rollout.tasks.calculator import TOOLS

pytestmark = pytest.mark.slow


def test_chat_tools_trace_has_exact_tokens_and_logprobs(srv_main, srv_client):
    raw = srv_client.chat.completions.with_raw_response.create(
        model="flywheel", messages=chat_messages(), tools=TOOLS, temperature=0, max_tokens=48, logprobs=True,
        extra_body={"return_token_ids": True, "episode_id": "ep-1", "turn": 2})
    trace_id = raw.headers["x-flywheel-trace-id"]
    resp = raw.parse()
    choice = resp.choices[0]
    row = srv_main.trace(trace_id)
    assert row["status"] == "ok" and row["episode_id"] == "ep-1" and row["turn"] == 2
    assert row["prompt_token_ids"] == resp.model_extra["prompt_token_ids"]
    assert row["completion_token_ids"] == choice.model_extra["token_ids"]
    client_lps = [t.logprob for t in choice.logprobs.content]
    assert row["completion_logprobs"] == pytest.approx(client_lps, abs=1e-5)
    assert row["weight_version"] == int(raw.headers["x-flywheel-weight-version"])
    assert row["checkpoint_sha256"] and row["stack"]["engine"] == "vllm" and row["stack"]["quant_format"] == "none"
    assert row["sampling"]["temperature"] == 0 and row["sampling"]["logprobs_mode"] == "processed_logprobs"
    assert json.loads(row["tools"]) == TOOLS and json.loads(row["messages"]) == chat_messages()
    out = json.loads(row["output"])
    assert row["finish_reason"] == choice.finish_reason
    if choice.message.tool_calls:  # the SFT'd tiny model calls the calculator
        assert out["tool_calls"][0]["function"]["name"] == choice.message.tool_calls[0].function.name
        assert out["tool_calls"][0]["function"]["arguments"] == choice.message.tool_calls[0].function.arguments
    else:
        assert out["content"] == choice.message.content
    assert row["ttft_ms"] > 0 and row["e2e_ms"] >= row["ttft_ms"]


def test_stream_records_logprobs_the_client_did_not_ask_for(srv_main):
    body = {"model": "flywheel", "messages": chat_messages("Ann has 5 apples and buys 3 more."), "stream": True,
            "temperature": 0.8, "seed": 7, "max_tokens": 24, "return_token_ids": True}
    with httpx.stream("POST", srv_main.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"x-flywheel-episode-id": "ep-stream", "x-flywheel-turn": "0"}) as r:
        assert r.status_code == 200
        trace_id = r.headers["x-flywheel-trace-id"]
        events = sse_events(r.read().decode())
    ids, text = [], ""
    for e in events:
        for c in e.get("choices", []):
            assert c.get("logprobs") is None  # not asked for: not sent
            ids += c.get("token_ids") or []
            text += (c.get("delta") or {}).get("content") or ""
    row = srv_main.trace(trace_id)
    assert row["completion_token_ids"] == ids and len(ids) > 0
    assert len(row["completion_logprobs"]) == len(ids) and all(lp <= 0 for lp in row["completion_logprobs"])
    assert row["episode_id"] == "ep-stream" and row["turn"] == 0 and row["sampling"]["seed"] == 7
    if "tool_calls" not in json.loads(row["output"]):
        assert json.loads(row["output"])["content"] == text


def test_logged_logprobs_are_the_sampling_distributions(srv_main, tiny_base, tiny_tokenizer):
    """At T=0.7 and top-p 0.9 the trace's behaviour logprobs are those of the distribution the
    token was drawn from (temperature, then the nucleus, renormalized), recomputed here by a
    float32 transformers forward; vLLM's raw logprobs (before both) would be far off."""
    row = sampled_row(srv_main, tiny_tokenizer, temperature=0.7, top_p=0.9)
    assert_sampling_logprobs(row, tiny_base.path, temperature=0.7, top_p=0.9)


def test_json_schema_response_format(srv_client):
    schema = {"type": "string", "enum": ["yes", "no"]}
    resp = srv_client.chat.completions.create(
        model="flywheel", messages=chat_messages("Is 2 bigger than 1?"), max_tokens=10,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(resp.choices[0].message.content) in ("yes", "no")


def test_completions_token_in_token_out_across_turns(srv_main, srv_client, tiny_tokenizer):
    """The agent collector's path: turn k+1's prompt extends turn k's prompt + completion exactly."""
    prompt = tiny_tokenizer.apply_chat_template(chat_messages(), tools=TOOLS, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    rows = []
    for turn in range(2):
        raw = srv_client.completions.with_raw_response.create(
            model="flywheel", prompt=prompt, max_tokens=12, temperature=1.0, logprobs=0,
            extra_body={"return_token_ids": True}, extra_headers={"x-flywheel-episode-id": "ep-tok",
                                                                  "x-flywheel-turn": str(turn)})
        choice = raw.parse().choices[0]
        row = srv_main.trace(raw.headers["x-flywheel-trace-id"])
        assert row["prompt_token_ids"] == prompt == choice.model_extra["prompt_token_ids"]
        assert row["completion_token_ids"] == choice.model_extra["token_ids"]
        assert row["completion_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
        rows.append(row)
        prompt = prompt + row["completion_token_ids"] + tiny_tokenizer.encode("\n<|im_start|>user\nok")
    assert [r["turn"] for r in rows] == [0, 1] and {r["episode_id"] for r in rows} == {"ep-tok"}


def test_prefix_cache_hits_reach_the_trace(srv_main, srv_client):
    rng = random.Random(3)
    prompt = [rng.randrange(10, 400) for _ in range(300)]  # unique: cold the first time
    ids = []
    for _ in range(2):
        raw = srv_client.completions.with_raw_response.create(model="flywheel", prompt=prompt, max_tokens=2,
                                                              temperature=0)
        ids.append(raw.headers["x-flywheel-trace-id"])
    rows = {r["trace_id"]: r for r in srv_main.traces()}
    assert rows[ids[0]]["num_cached_prompt_tokens"] == 0
    assert rows[ids[1]]["num_cached_prompt_tokens"] >= 256
    metrics = httpx.get(srv_main.url + "/metrics").text
    hits = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("flywheel_prefix_cache_hit_tokens_total")]
    assert hits and hits[0] >= 256


def test_aborted_stream_is_traced(srv_main):
    import time

    body = {"model": "flywheel", "prompt": "x" * 50, "stream": True, "max_tokens": 300, "temperature": 1.0,
            "ignore_eos": True}

    def hang_up_after_first_chunk() -> dict:
        with httpx.stream("POST", srv_main.url + "/v1/completions", json=body, timeout=60) as r:
            trace_id = r.headers["x-flywheel-trace-id"]
            next(r.iter_raw())  # first chunk, then hang up
        deadline = time.time() + 30
        while time.time() < deadline:
            if rows := [x for x in srv_main.traces() if x["trace_id"] == trace_id]:
                return rows[0]
            time.sleep(0.5)
        raise AssertionError(f"no trace row for {trace_id}")

    # the tiny model can finish all 300 tokens before the hang-up reaches the server (then the row
    # is rightly "ok"); a few tries make the race go our way
    for _ in range(5):
        row = hang_up_after_first_chunk()
        assert row["status"] in ("ok", "aborted")
        if row["status"] == "aborted":
            break
        assert len(row["completion_token_ids"]) == 300
    assert row["status"] == "aborted" and len(row["completion_token_ids"]) < 300


BAD = [
    ("malformed json", "/v1/chat/completions", b"{not json", 400),
    ("unknown model", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("too many tokens", "/v1/chat/completions",
     {"model": "flywheel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400),
    ("prompt too long", "/v1/completions", {"model": "flywheel", "prompt": [5] * 1000, "max_tokens": 2}, 400),
    ("bad types", "/v1/chat/completions", {"model": "flywheel", "messages": "hello", "temperature": "hot"}, 400),
    ("tool without name", "/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user", "content": "x"}],
                                                   "tools": [{"type": "function", "function": {"parameters": {}}}]}, 400),
    ("tool schema invalid", "/v1/chat/completions",
     {"model": "flywheel", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, 400),
    ("json schema invalid", "/v1/chat/completions",
     {"model": "flywheel", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "bogus"}}}}, 400),
    ("token id out of vocab", "/v1/completions", {"model": "flywheel", "prompt": [10 ** 6], "max_tokens": 2}, 400),
    ("body not an object", "/v1/completions", [1, 2], 400),
    ("oversize body", "/v1/chat/completions", b"x" * (5 * 1024 * 1024), 413),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx(srv_main, name, path, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(srv_main.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert httpx.get(srv_main.url + "/health").status_code == 200


def test_failed_requests_are_traced_with_their_status(srv_main):
    r = httpx.post(srv_main.url + "/v1/chat/completions", json={"model": "nope", "messages": []})
    row = srv_main.trace(r.headers["x-flywheel-trace-id"])
    assert row["status"] == "error" and "nope" in row["error"] and row["completion_token_ids"] == []


def test_overload_answers_429_with_retry_after(srv_main):
    # 40 long generations sent at once from one event loop (threads that each build an HTTP client
    # trickled in slower than the tiny model finished them): the 13th and later meet the limit of 12
    body = {"model": "flywheel", "prompt": "count", "max_tokens": 300, "ignore_eos": True}

    async def burst():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
            async def one():
                async with s.post(srv_main.url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r
            return await asyncio.gather(*(one() for _ in range(40)))

    responses = asyncio.run(burst())
    codes = [r.status for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 12
    assert all(r.headers.get("retry-after") for r in responses if r.status == 429)
    rejected = next(r for r in responses if r.status == 429)
    row = srv_main.trace(rejected.headers["x-flywheel-trace-id"])
    assert row["status"] == "error" and "queue limit" in row["error"]


def test_feedback_lands_in_the_feedback_table(srv_main, srv_client):
    from rollout.traces import read_feedback

    raw = srv_client.chat.completions.with_raw_response.create(model="flywheel", messages=chat_messages(),
                                                               max_tokens=4)
    trace_id = raw.headers["x-flywheel-trace-id"]
    r = httpx.post(srv_main.url + "/v1/feedback", json={"trace_id": trace_id, "reward": 1.0, "source": "env:calc"})
    assert r.status_code == 200, r.text
    for bad in ({"trace_id": trace_id}, {"trace_id": trace_id, "reward": "high"}, {"reward": 1.0},
                {"trace_id": trace_id, "reward": 1, "extra": 1}):
        assert httpx.post(srv_main.url + "/v1/feedback", json=bad).status_code == 400
    assert httpx.post(srv_main.url + "/v1/feedback", content=b"{x").status_code == 400
    # an array is all or nothing: one bad item refuses the whole batch, naming the item
    batch = [{"trace_id": trace_id, "rating": 1, "source": "user"}, {"trace_id": trace_id, "reward": 0.5}]
    bad = httpx.post(srv_main.url + "/v1/feedback", json=batch + [{"trace_id": trace_id, "reward": "x"}])
    assert bad.status_code == 400 and "item 2" in bad.json()["error"]["message"]
    for empty in ([], [{}] * 1001):
        assert httpx.post(srv_main.url + "/v1/feedback", json=empty).status_code == 400
    ok = httpx.post(srv_main.url + "/v1/feedback", json=batch)
    assert ok.status_code == 200 and [x["trace_id"] for x in ok.json()["data"]] == [trace_id] * 2
    # a client-chosen feedback_id is an idempotency key: the retry is answered, not written again
    keyed = {"trace_id": trace_id, "reward": 0.25, "source": "env:calc", "feedback_id": f"fb-{trace_id}"}
    for _ in range(2):
        again = httpx.post(srv_main.url + "/v1/feedback", json=keyed)
        assert again.status_code == 200 and again.json()["feedback_id"] == f"fb-{trace_id}"
    assert httpx.post(srv_main.url + "/v1/feedback", json=[keyed, keyed]).status_code == 200
    assert httpx.post(srv_main.url + "/v1/feedback", json={**keyed, "feedback_id": ""}).status_code == 400
    srv_main.flush()
    rows = read_feedback(srv_main.trace_root).to_pylist()
    got = [(x["reward"], x["rating"], x["source"]) for x in rows if x["trace_id"] == trace_id]
    assert sorted(got, key=repr) == sorted([(1.0, None, "env:calc"), (None, 1, "user"), (0.5, None, "user"),
                                            (0.25, None, "env:calc")], key=repr)


def test_metrics_have_vllm_and_flywheel_series(srv_main, srv_client):
    srv_client.completions.create(model="flywheel", prompt="hello", max_tokens=3)
    text = httpx.get(srv_main.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:prefix_cache_queries", "flywheel_weight_version",
                 "flywheel_prefix_cache_hit_rate", "flywheel_spec_draft_tokens_total", "traces_written_total",
                 "trace_write_seconds_bucket", "flywheel_weight_swaps_total"):
        assert name in text, name
    written = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("traces_written_total")]
    assert written[0] >= 1


def test_models_and_health(srv_client, srv_main):
    assert [m.id for m in srv_client.models.list().data] == ["flywheel"]
    assert httpx.get(srv_main.url + "/health").status_code == 200


def test_admin_auth(srv_main):
    url = srv_main.url + "/admin/weights"
    assert httpx.post(url, json={"path": "/nonexistent"}).status_code == 401
    assert httpx.post(url, json={"path": "/nonexistent"}, headers={"authorization": "Bearer wrong"}).status_code == 403
    r = httpx.post(url, json={"path": "/nonexistent"}, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 403 and "outside serve.weights_roots" in r.json()["error"]["message"]
    inside = f"{tempfile.gettempdir()}/flywheel-nonexistent"  # the tests' servers allow the temp dir
    r = httpx.post(url, json={"path": inside}, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 400 and "config.json" in r.json()["error"]["message"]
    assert httpx.get(srv_main.url + "/admin/status").status_code == 401
