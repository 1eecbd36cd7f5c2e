"""A byte-level BPE tokenizer with a ChatML template and Hermes tool-call markup, trained here.

Invariants the rest of Flywheel relies on:
- Digits and arithmetic operators are single tokens (numbers are copied digit by digit).
- `<|im_start|>`, `<|im_end|>`, `<|endoftext|>` are special tokens; `<tool_call>`, `</tool_call>`,
  `<tool_response>`, `</tool_response>` are single, non-special added tokens so they survive
  decoding and vLLM's `hermes` tool parser finds them.
- `<|im_end|>` is the end-of-turn (EOS) token; `<|endoftext|>` pads.
- The chat template renders OpenAI messages with `tools`, assistant `tool_calls` (arguments as a
  JSON string or an object) and `tool` results, Qwen2.5-style, so the same rendering serves both
  SFT and the OpenAI endpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}\
{%- else %}{% set system = 'You are a helpful assistant.' %}{% set rest = messages %}{% endif %}\
<|im_start|>system
{{ system }}{% if tools %}
<tools>
{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}
{% endfor %}</tools>{% endif %}<|im_end|>
{% for m in rest %}\
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}\
{%- for tc in (m.tool_calls or []) %}{% set f = tc.function if tc.function is defined else tc %}\
{%- if loop.index0 > 0 or m.content %}
{% endif %}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else (f.arguments | tojson) }}}
</tool_call>\
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}\
{%- endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[0-9+\-*/()]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int):
    """Wrap in a transformers fast tokenizer with the chat template and save it to `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return hf


def render_texts(conversations: list[list[dict]], tools: list[dict]) -> list[str]:
    """Render conversations with CHAT_TEMPLATE before any tokenizer exists (to train one)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=conversations, tools=tools, chat_template=CHAT_TEMPLATE)
    return rendered
