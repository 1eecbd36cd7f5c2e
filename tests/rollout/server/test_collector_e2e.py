"""End to end: the collector plays 2 groups x 4 calculator episodes against the real server (the
shared `srv_main`), then the dataset build turns the server's traces and feedback into samples.
Every kept episode holds exactly the tokens and behaviour logprobs the server returned to the
client, masks cover exactly the sampled tokens, and planted traces (a re-tokenized turn: kept as segments, an
episode without a reward, a duplicated row) are dropped and counted.

This file lives beside the server tests to share their server (one engine per session); the
episodes are copied out of the shared trace root so other tests' traffic does not enter the
window, along with real extra requests that plant the faults."""

from __future__ import annotations

import uuid
from dataclasses import replace

import httpx
import numpy as np
import pyarrow.parquet as pq

from pipelines.traces_to_dataset import DatasetConfig, build_dataset
from rollout.chat import ChatFormat
from rollout.collector import CollectorConfig, collect_sync
from rollout.tasks.calculator import TASK, SYSTEM_PROMPT, make_problems
from rollout.traces import Feedback, Trace, TraceConfig, TraceWriter, read_feedback, read_traces
from rollout.traces.feedback import FeedbackStore


def test_collect_through_the_server_then_build_the_dataset(srv_main, tiny_tokenizer, tiny_base, tmp_path):
    run = uuid.uuid4().hex[:8]
    cfg = CollectorConfig(base_url=srv_main.url, group_size=4, concurrency=8, temperature=1.0, max_tokens=48,
                          progress=False, run_id=run)
    results, stats = collect_sync(make_problems("train", 2, seed=9), tiny_tokenizer, cfg, TASK)
    assert stats.episodes_ok == 8, [r.error for r in results]
    two_turn = [r for r in results if len(r.turns) == 2]
    assert two_turn, "the tiny model should call the calculator"

    # a planted episode no reward can judge: a real request, off-task, with no feedback
    chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is the capital of France?"}]
    r = httpx.post(srv_main.url + "/v1/completions", timeout=120, json={
        "model": "flywheel", "prompt": ChatFormat.of(tiny_tokenizer, TASK.tools).prompt(chat), "max_tokens": 8, "temperature": 1.0,
        "logprobs": 0, "return_token_ids": True, "episode_id": f"{run}-noreward", "turn": 0})
    assert r.status_code == 200

    srv_main.flush()
    rows = [t for t in read_traces(srv_main.trace_root).to_pylist() if (t["episode_id"] or "").startswith(run)]
    fb = [f for f in read_feedback(srv_main.trace_root).to_pylist() if (f["episode_id"] or "").startswith(run)]
    assert len(rows) == sum(len(r.turns) for r in results) + 1 and len(fb) == 8
    for t in rows:
        s = t["sampling"]
        assert (s["temperature"], s["top_p"], s["top_k"], s["logprobs_mode"]) == (1.0, 1.0, -1, "processed_logprobs")

    traces = [Trace.from_row(t) for t in rows]
    by_id = {t.trace_id: t for t in traces}
    # planted: a misaligned copy of a two-turn episode, and a duplicated row of a kept one
    a, b = (by_id[t.trace_id] for t in two_turn[0].turns)
    p1 = list(b.prompt_token_ids)
    p1[len(a.prompt_token_ids)] = (p1[len(a.prompt_token_ids)] + 1) % 300
    planted = [replace(a, trace_id="mis-0", episode_id=f"{run}-mis"),
               replace(b, trace_id="mis-1", episode_id=f"{run}-mis", prompt_token_ids=p1),
               replace(by_id[results[-1].turns[0].trace_id])]
    root = tmp_path / "data"
    with TraceWriter(TraceConfig(root=root, durability="interval")) as w:
        for t in traces + planted:
            w.append_sync(t)
    with FeedbackStore(root) as store:
        for f in fb:
            store.append_sync(Feedback(**{k: f[k] for k in ("feedback_id", "trace_id", "episode_id", "reward",
                                                               "rating", "comment", "source", "created_at")}))

    m = build_dataset(DatasetConfig(trace_root=root, out_dir=tmp_path / "ds", tokenizer=str(tiny_base.path),
                                    heldout_fraction=0.0, logprobs_mode="processed_logprobs"))
    assert m.dropped_rows == {"duplicate_trace": 1, "duplicate_turn": 0, "status_not_ok": 0}
    assert m.dropped_episodes == {"missing_reward": 1}
    # the re-tokenized copy: kept as two rows (segments), each exactly as sampled
    assert (m.split_episodes, m.segment_rows) == (1, 2)
    assert m.train_episodes == 8 + 2 and m.groups == 3
    out = {row["episode_id"]: row for f in m.files_of("train") for row in pq.read_table(f).to_pylist()}
    for ep in results:
        row, last = out[ep.episode_id], ep.turns[-1]
        assert row["input_ids"] == last.prompt_ids + last.token_ids  # what the client sent and received
        n = len(row["input_ids"])
        mask, lps = np.zeros(n, np.int8), np.zeros(n, np.float32)
        for t in ep.turns:
            s = len(t.prompt_ids)
            assert row["input_ids"][s:s + len(t.token_ids)] == t.token_ids
            mask[s:s + len(t.token_ids)] = 1
            lps[s:s + len(t.token_ids)] = t.logprobs
        assert row["assistant_mask"] == mask.tolist()
        assert row["behaviour_logprobs"] == lps.tolist()  # the client's JSON floats, as float32: exact
        assert row["trace_ids"] == [t.trace_id for t in ep.turns]
        assert row["reward"] == ep.reward and row["weight_version"] == ep.turns[0].weight_version
    assert len({out[ep.episode_id]["group_id"] for ep in results}) == 2
    assert all(len({out[e.episode_id]["group_id"] for e in results if e.group == g}) == 1 for g in (0, 1))
