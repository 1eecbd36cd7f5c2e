"""`loop run base.model=DIR` on models of other families than the bootstrap's default, built here:
a Llama (Llama 3.1's chat format and JSON tool calls, untied embeddings), a Mistral ([INST]
blocks, [TOOL_CALLS] JSON with call ids, [TOOL_RESULTS]; only assistant turns end in </s>) and a
Gemma 3 (`model` turns, pythonic calls, no system turn: the system prompt opens the first user turn), each
through a whole cycle (serve quantized -> collect -> dataset -> GRPO + QAT -> requantize -> gate
-> promote) against a `loop serve` of it, its tool calls read by vLLM's parser for the family
(`llama3_json`, `mistral`, `pythonic`) in the collector and, for an outside agent, at the same endpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FAMILIES = {"llama": ("LlamaForCausalLM", "llama3_json"), "mistral": ("MistralForCausalLM", "mistral"),
            "gemma": ("Gemma3ForCausalLM", "pythonic")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_base(request, tiny_cfg):
    from loop.bootstrap import bootstrap

    model = dataclasses.replace(tiny_cfg.bootstrap.model, family=request.param)
    return request.param, bootstrap(dataclasses.replace(tiny_cfg.bootstrap, model=model), tiny_cfg.task)


def test_a_model_of_another_family_runs_a_cycle_with_its_own_chat_format(family_base, tiny_cfg, tmp_path):
    from transformers import AutoTokenizer

    from rollout.chat import ChatFormat
    from rollout.server.process import ServerProcess
    from rollout.tasks.calculator import TASK, TOOLS, make_problems
    from rollout.traces import read_traces

    family, base = family_base
    arch, parser = FAMILIES[family]
    assert json.loads(Path(base.path, "config.json").read_text())["architectures"] == [arch]
    run_dir, token = tmp_path / "run", "tok-" + secrets.token_hex(8)
    cache = f"bootstrap.cache_dir={tiny_cfg.bootstrap.cache_dir}"
    with ServerProcess(REPO / "conf" / "tiny.yaml", base.path, run_dir / "data", tmp_path / "srv.log",
                       [cache, "serve.quant=auto", f"run_dir={run_dir}"], admin_token=token) as srv:
        before = srv.admin("GET", "/admin/status").json()["path"]  # the base, quantized for serving
        out = subprocess.run([sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", f"base.model={base.path}",
                              cache, f"run_dir={run_dir}", "serve.quant=auto", "loop.cycles=1",
                              "collect.num_problems=4", "collect.rollout.group_size=8", "collect.rollout.max_tokens=32",
                              "dataset.heldout_unit=episode", "dataset.heldout_fraction=0.25",
                              f"collect.endpoint={srv.url}"],
                             capture_output=True, text=True, timeout=1200, cwd=REPO,
                             env={**os.environ, "FLYWHEEL_ADMIN_TOKEN": token})
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
        state = json.loads((run_dir / "loop_state.json").read_text())
        c1 = state["cycles"][0]
        assert list(c1["done"]) == ["collect", "build_dataset", "train", "requantize", "validate", "promote"]
        assert c1["outcome"] in ("serving", "rejected") and c1["done"]["train"]["parent"] == base.path
        served = srv.admin("GET", "/admin/status").json()["path"]
        assert served == (c1["done"]["requantize"]["path"] if c1["outcome"] == "serving" else before)

        # the traced turns read back through the family's framing; sampled calls parsed by its parser
        tok = AutoTokenizer.from_pretrained(base.path)
        chat = ChatFormat.of(tok, TASK.tools)
        assert chat.parser_name == parser
        rows = read_traces(run_dir / "data", columns=["turn", "prompt_token_ids", "completion_token_ids"]).to_pylist()
        calls = 0
        for r in rows:
            msgs = chat.messages(tok.decode(r["prompt_token_ids"] + r["completion_token_ids"],
                                            skip_special_tokens=False))
            assert [m["role"] for m in msgs[:2]] == ["system", "user"] and msgs[-1]["role"] == "assistant", msgs
            assert [m["role"] for m in msgs[2:]] == ["assistant", "tool", "assistant"][-(len(msgs) - 2):] or r["turn"] == 0
            calls += bool(msgs[-1]["tool_calls"])
        assert calls > 0, f"the SFT'd {family} never called the calculator"

        # an outside agent on the same endpoint (now serving the cycle's outcome) gets the same
        # parse: OpenAI tool_calls from the family's parser, and a multi-turn conversation with the
        # ids it was given renders and answers
        p = make_problems("eval", 1, seed=2)[0]
        got = []
        for seed in range(12):
            r = httpx.post(srv.url + "/v1/chat/completions", json={
                "model": "flywheel", "messages": p.messages(), "tools": TOOLS, "temperature": 1.0, "seed": seed,
                "max_tokens": 32}, timeout=60).json()
            got.append(r["choices"][0]["message"])
        called = [m for m in got if m.get("tool_calls")]
        assert called, got
        assert all(c["function"]["name"] and json.loads(c["function"]["arguments"]) is not None
                   for m in called for c in m["tool_calls"])
        msg = called[0]
        call = msg["tool_calls"][0]
        again = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": "flywheel", "tools": TOOLS, "max_tokens": 16, "messages": [
                *p.messages(), {"role": "assistant", "content": msg.get("content"), "tool_calls": msg["tool_calls"]},
                {"role": "tool", "tool_call_id": call["id"], "content": "7"}]}, timeout=60)
        assert again.status_code == 200, again.text
