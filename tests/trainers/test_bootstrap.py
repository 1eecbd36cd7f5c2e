"""The base model the project builds itself: tokenizer invariants, SFT masks, and that the folder
loads and generates tool calls in transformers and in the real vLLM engine."""

import json

import pytest
import torch

from rollout.chat import ChatFormat
from rollout.chat import encode_demo
from rollout.episode import Completion, after_turn, hf_generate, run_episodes
from rollout.tasks.calculator import TASK, TOOLS, demonstration, make_problems
from trainers.bootstrap.tokenizer import TOOL_TOKENS


def test_tokenizer_invariants(tiny_tokenizer):
    tok = tiny_tokenizer
    for t in TOOL_TOKENS + ["<|im_start|>", "<|im_end|>"]:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    digits = tok("12345+67*(8-9)/0", add_special_tokens=False)["input_ids"]
    assert len(digits) == 16  # every digit and operator is its own token
    assert tok.decode(tok("<tool_call>\n{}</tool_call>", add_special_tokens=False)["input_ids"]) == "<tool_call>\n{}</tool_call>"


def test_sft_mask_covers_exactly_the_assistant_turns(tiny_tokenizer):
    tok = tiny_tokenizer
    demo = demonstration(make_problems("train", 1)[0])
    ids, mask = encode_demo(tok, demo, TOOLS)
    spans, cur = [], []
    for i, m in enumerate(mask):
        if m:
            cur.append(ids[i])
        elif cur:
            spans.append(cur)
            cur = []
    assert len(spans) == 2
    call, answer = (tok.decode(s) for s in spans)
    assert call.startswith("<tool_call>") and call.endswith("</tool_call><|im_end|>")
    assert json.loads(call.split("\n")[1])["arguments"]["expression"] == demo[2]["tool_calls"][0]["function"]["arguments"].split('"')[3]
    assert answer == demo[-1]["content"] + "<|im_end|>"


def test_sft_takes_its_demonstrations_and_evaluate_from_the_caller(tiny_cfg, tiny_tokenizer):
    """trainers/ knows no task: SFT trains on the chats it is given and stops when the caller's
    `evaluate(model)` reaches target_success (evaluated every eval_every steps from min_steps)."""
    from trainers.bootstrap.model import build_model
    from trainers.bootstrap.sft import SFTConfig, sft

    model = build_model(tiny_cfg.bootstrap.model, tiny_tokenizer, seed=0)
    demos = [demonstration(p) for p in make_problems("train", 4)]
    seen = []

    def evaluate(m) -> float:
        seen.append(m)
        return 0.5 * len(seen)

    cfg = SFTConfig(batch_size=2, warmup_steps=1, min_steps=2, eval_every=2, max_steps=20, target_success=1.0)
    result = sft(model, tiny_tokenizer, cfg, [encode_demo(tiny_tokenizer, d, TOOLS) for d in demos], evaluate)
    assert (result.steps, result.eval_success, len(seen)) == (4, 1.0, 2) and all(m is model for m in seen)
    assert [h["step"] for h in result.history if "sft/eval_success" in h] == [2, 4]


def test_episode_tokens_extend_exactly(tiny_tokenizer):
    """Turn 2's prompt (built token-in/token-out) equals the chat template's own rendering."""
    tok = tiny_tokenizer
    demo = demonstration(make_problems("eval", 1)[0])
    turn1 = ChatFormat.of(tok, TASK.tools).prompt(demo[:2])
    completion = tok(tok.apply_chat_template(demo[:3], tools=TOOLS, tokenize=False)[
        len(tok.apply_chat_template(demo[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True)):
    ].split("<|im_end|>")[0] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    turn2 = turn1 + completion + after_turn(ChatFormat.of(tok, TASK.tools), demo[:3], [demo[3]])[1]
    assert turn2 == ChatFormat.of(tok, TASK.tools).prompt(demo[:4])


def test_base_model_generates_tool_calls_in_transformers(tiny_base, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32).eval()
    eps = run_episodes(make_problems("eval", 16, seed=7), tiny_tokenizer, hf_generate(model, tiny_tokenizer),
                       task=TASK, temperature=0.0)
    calls = [e for e in eps if e.messages[2].get("tool_calls")]
    assert len(calls) >= 12, [e.messages[2] for e in eps]
    # the calls are well-formed calculator calls the environment could run
    assert sum(e.messages[3]["role"] == "tool" and not e.messages[3]["content"].startswith("error")
               for e in calls) >= 10


@pytest.mark.slow
def test_base_model_in_vllm_matches_transformers(tiny_base, tiny_tokenizer, tiny_llm):
    from transformers import AutoModelForCausalLM
    from transformers.utils.import_utils import is_kernels_available

    from rollout.engine import vllm_generate

    # flywheel's `kernels/` package must not pass for Hugging Face's `kernels`
    assert not is_kernels_available()
    problems = make_problems("eval", 16, seed=7)
    eps_vllm = run_episodes(problems, tiny_tokenizer, vllm_generate(tiny_llm), task=TASK, temperature=0.0)
    assert sum(bool(e.messages[2].get("tool_calls")) for e in eps_vllm) >= 12
    model = AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32).eval()
    eps_hf = run_episodes(problems, tiny_tokenizer, hf_generate(model, tiny_tokenizer), task=TASK, temperature=0.0)
    # fp32 greedy: the engine and transformers agree token for token on (nearly) every episode
    same = sum(a.turns[0].completion.token_ids == b.turns[0].completion.token_ids for a, b in zip(eps_vllm, eps_hf))
    assert same >= 14
    # behaviour logprobs come back for every sampled token, and are log-probabilities
    first = eps_vllm[0].turns[0].completion
    assert isinstance(first, Completion) and len(first.logprobs) == len(first.token_ids)
    assert all(lp <= 0 for lp in first.logprobs)


def test_sft_lr_schedule_warms_up_then_holds_or_decays_to_a_tenth():
    from trainers.bootstrap.sft import SFTConfig, lr_factor

    const = SFTConfig(warmup_steps=10, max_steps=110)
    cos = SFTConfig(warmup_steps=10, max_steps=110, lr_schedule="cosine")
    assert [lr_factor(c, 4) for c in (const, cos)] == [0.5, 0.5]
    assert lr_factor(const, 109) == 1.0 and lr_factor(cos, 10) == 1.0
    assert abs(lr_factor(cos, 60) - 0.55) < 1e-9 and abs(lr_factor(cos, 110) - 0.1) < 1e-9
    assert lr_factor(SFTConfig(warmup_steps=0, max_steps=100, lr_schedule="cosine"), 0) == 1.0  # no warmup
    with pytest.raises(ValueError, match="lr_schedule"):
        SFTConfig(lr_schedule="linear")


def test_a_constant_sft_schedule_keeps_the_bases_cache_key():
    """The default's base (built before SFT had a schedule) keeps its key, so a cached one stays
    valid; a cosine schedule is another base."""
    from dataclasses import replace
    from pathlib import Path

    from loop.bootstrap import cache_key
    from loop.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "conf" / "agent_rl.yaml")
    b = cfg.bootstrap
    assert cache_key(b, cfg.task) == "57113766ea57"
    assert cache_key(replace(b, sft=replace(b.sft, lr_schedule="cosine")), cfg.task) != "57113766ea57"
