"""`loop run base.model=DIR` on a model of another family than the bootstrap's default: a Llama
(Llama 3.1's chat format and JSON tool calls, untied embeddings) built here, through a whole cycle
(serve quantized -> collect -> dataset -> GRPO + QAT -> requantize -> gate -> promote), its tool
calls read by vLLM's `llama3_json` parser at the endpoint and in the collector alike."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama_base(tiny_cfg):
    from loop.bootstrap import bootstrap

    model = dataclasses.replace(tiny_cfg.bootstrap.model, family="llama")
    return bootstrap(dataclasses.replace(tiny_cfg.bootstrap, model=model), tiny_cfg.task)


def test_a_llama_model_runs_a_cycle_with_its_own_chat_format(llama_base, tmp_path):
    from transformers import AutoTokenizer

    from rollout.chat import ChatFormat
    from rollout.server.process import ServerProcess
    from rollout.tasks.calculator import TASK, TOOLS, make_problems
    from rollout.traces import read_traces

    assert json.loads(Path(llama_base.path, "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "loop.cli", "run", "conf/tiny.yaml", f"base.model={llama_base.path}",
                          f"run_dir={run_dir}", "serve.quant=auto", "loop.cycles=1", "collect.num_problems=4",
                          "collect.rollout.group_size=8", "collect.rollout.max_tokens=32",
                          "dataset.heldout_unit=episode", "dataset.heldout_fraction=0.25"],
                         capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    state = json.loads((run_dir / "loop_state.json").read_text())
    c1 = state["cycles"][0]
    assert list(c1["done"]) == ["collect", "build_dataset", "train", "requantize", "validate", "promote"]
    assert c1["outcome"] in ("serving", "rejected") and c1["done"]["train"]["parent"] == llama_base.path

    # the traced turns read back through Llama's framing; sampled calls parsed by llama3_json
    tok = AutoTokenizer.from_pretrained(llama_base.path)
    chat = ChatFormat.of(tok, TASK.tools)
    assert chat.parser_name == "llama3_json"
    rows = read_traces(run_dir / "data", columns=["turn", "prompt_token_ids", "completion_token_ids"]).to_pylist()
    calls = 0
    for r in rows:
        msgs = chat.messages(tok.decode(r["prompt_token_ids"] + r["completion_token_ids"], skip_special_tokens=False))
        assert [m["role"] for m in msgs[:2]] == ["system", "user"] and msgs[-1]["role"] == "assistant"
        assert [m["role"] for m in msgs[2:]] == ["assistant", "tool", "assistant"][-(len(msgs) - 2):] or r["turn"] == 0
        calls += bool(msgs[-1]["tool_calls"])
    assert calls > 0, "the SFT'd Llama never called the calculator"

    # an outside agent on the endpoint gets the same parse: OpenAI tool_calls from llama3_json
    with ServerProcess(REPO / "conf" / "tiny.yaml", llama_base.path, tmp_path / "srv", tmp_path / "srv.log") as srv:
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
