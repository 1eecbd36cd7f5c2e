"""Model families other than the default Qwen2: each with its own chat format (Qwen3's think
blocks, Llama 3.1's headers and JSON tool calls, Mistral's [INST] blocks, [TOOL_CALLS] and
[TOOL_RESULTS] with call ids, Gemma 3's turns with pythonic calls and no system turn), played token-in/token-out by `rollout.chat`,
its tool calls read by vLLM's parser for it, and `base.model` checked at config load."""

from __future__ import annotations

import json
import shutil

import pytest

from rollout.chat import ChatFormat, encode_demo
from rollout.episode import after_turn, agent_step
from rollout.tasks.calculator import TASK, TOOLS, calculator, demonstration, make_problems, problem_from_question, reward
from trainers.bootstrap.model import FAMILIES, ModelConfig, build_model
from trainers.bootstrap.tokenizer import render_texts, save_hf_tokenizer, train_tokenizer

PARSERS = {"qwen2": "hermes", "qwen3": "hermes", "llama": "llama3_json", "mistral": "mistral", "gemma": "pythonic"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    fam = request.param
    texts = render_texts([demonstration(p) for p in make_problems("train", 300, 0)], TOOLS, fam)
    out = tmp_path_factory.mktemp(fam)
    return fam, save_hf_tokenizer(train_tokenizer(texts, 512, fam), out, 512, fam)


@pytest.mark.parametrize("fam", FAMILIES)
def test_a_tool_renders_as_its_signature_whatever_flags_the_client_sends(fam):
    """The Agents SDK sends every function with `"strict": false` (an API flag, not part of the
    signature): the model reads the very prompt it was trained on; a tool without a description
    renders without one."""
    problem = make_problems("eval", 1, 0)[0].messages()
    sdk = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}]
    assert render_texts([problem], sdk, fam) == render_texts([problem], TOOLS, fam)
    assert "strict" not in render_texts([problem], sdk, fam)[0]
    bare = render_texts([problem], [{"type": "function", "function": {"name": "ping", "parameters": {}}}], fam)[0]
    assert '{"name": "ping", "parameters": {}}' in bare


def test_each_family_plays_episodes_token_in_token_out(family):
    fam, tok = family
    chat = ChatFormat.of(tok, TASK.tools)
    assert chat.parser_name == PARSERS[fam]
    for p in make_problems("eval", 20, seed=4):
        demo = demonstration(p)
        ids, mask = encode_demo(tok, demo, TOOLS)
        # SFT trains on the episode the collector builds: prompt, call, tool result + next header, answer
        call = chat.ids(chat.assistant_text(demo[:3]))
        answer = chat.ids(chat.assistant_text(demo))
        msgs, more = after_turn(chat, demo[:3], [demo[3]])
        played = chat.prompt(demo[:2]) + call + more + answer
        assert ids[:len(played)] == played and sum(mask) == len(call) + len(answer)
        assert call[-1] == answer[-1] == tok.eos_token_id
        # vLLM's parser for the family reads the sampled call; the calculator answers it
        msg, results = agent_step(chat, TASK.env(p), call, "stop")
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"expression": p.expression}
        assert results == [demo[3]] and demo[3]["content"] == calculator(p.expression)
        assert agent_step(chat, TASK.env(p), answer, "stop") == ({"role": "assistant", "content": f"Answer: {p.answer}",
                                                    "tool_calls": None}, None)
        # the played tokens read back into the conversation, rewarded as the demonstration is
        back = chat.messages(tok.decode(played, skip_special_tokens=False))
        assert [m["role"] for m in back] == ["system", "user", "assistant", "tool", "assistant"]
        assert back[1]["content"] == p.question and back[3]["content"] == demo[3]["content"]
        assert reward(problem_from_question(back[1]["content"]), back) == 1.0
    whole = chat.render(demo, False)  # arguments as a mapping, as vLLM's server passes them (Gemma's template needs one)
    if fam == "qwen3":  # past turns lose their (empty) think block once another turn follows
        assert whole.count("<think>") == 1 and tok.decode(played, skip_special_tokens=False).count("<think>") == 2
    else:  # the template renders the conversation as it was played
        assert tok.decode(ids, skip_special_tokens=False) == whole


def test_a_conversation_with_the_clients_call_ids_reads_back(family):
    """An agent on the endpoint sends back the call ids vLLM's parser gave it (Mistral: 9 random
    characters, of which the template renders the last 9): any id reads back as the same messages."""
    fam, tok = family
    chat = ChatFormat.of(tok, TASK.tools)
    p = make_problems("eval", 1, seed=5)[0]
    demo = demonstration(p)
    for cid in ("call_0", "Ab3dE6gH9", "chatcmpl-tool-8d2f41c0aa"):
        convo = [*demo[:2], {**demo[2], "tool_calls": [{**demo[2]["tool_calls"][0], "id": cid}]},
                 {**demo[3], "tool_call_id": cid}, demo[4]]
        back = chat.messages(chat.render(convo, False))
        assert [m["role"] for m in back] == ["system", "user", "assistant", "tool", "assistant"], (cid, back)
        assert back[3]["content"] == demo[3]["content"] and back[4]["content"] == f"Answer: {p.answer}"
        assert json.loads(back[2]["tool_calls"][0]["function"]["arguments"]) == {"expression": p.expression}


def test_each_family_builds_an_architecture_vllm_serves(family, tmp_path):
    from rollout.engine import check_servable

    fam, tok = family
    cfg = ModelConfig(family=fam, vocab_size=512, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=128)
    model = build_model(cfg, tok)
    model.save_pretrained(tmp_path)
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM", "gemma": "Gemma3ForCausalLM"}[fam]
    assert check_servable(str(tmp_path)) == arch
    assert model.config.tie_word_embeddings == (fam in ("qwen2", "qwen3", "gemma"))  # a separate lm_head, as the 7B/8B have
    with pytest.raises(ValueError, match="family must be one of"):
        ModelConfig(family="gpt2")


def test_base_model_is_checked_at_config_load(tiny_base, tmp_path):
    from loop.config import load_config
    from loop.configs import ConfigError

    cfg = load_config("conf/tiny.yaml", [f"base.model={tiny_base.path}"])
    assert cfg.bootstrap.model.path == tiny_base.path
    with pytest.raises(ConfigError, match=r"base: model: .* \(no config.json\)"):
        load_config("conf/tiny.yaml", [f"base.model={tmp_path}"])
    odd = tmp_path / "odd"
    shutil.copytree(tiny_base.path, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["MadeUpForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"base: model: .* vLLM serves none of its architectures \['MadeUp"):
        load_config("conf/tiny.yaml", [f"base.model={odd}"])
    plain = tmp_path / "plain"
    shutil.copytree(tiny_base.path, plain)
    (plain / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ConfigError, match="serve.tool_call_parser: auto .* renders no tool calls"):
        load_config("conf/tiny.yaml", [f"base.model={plain}"])
    with pytest.raises(ConfigError, match="serve.tool_call_parser none: the calculator task calls tools"):
        load_config("conf/tiny.yaml", [f"base.model={plain}", "serve.tool_call_parser=none"])
