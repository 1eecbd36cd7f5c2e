"""A byte-level BPE tokenizer trained here, with each model family's chat format.

`qwen2` (the default): ChatML with Hermes tool-call markup, below. `qwen3`: ChatML, Qwen3's tools
block and its think blocks (an empty one opens each generated turn, and past turns drop theirs).
`llama`: Llama 3.1's headers, `<|eot_id|>`, JSON tool calls (`{"name", "parameters"}`, vLLM's
`llama3_json` parser) and `ipython` tool results. `mistral`: [INST] blocks, [AVAILABLE_TOOLS] and [TOOL_CALLS] JSON (vLLM's
`mistral` parser), [TOOL_RESULTS]; only an assistant turn ends in </s>. `gemma`: Gemma 3's turns
(`<start_of_turn>user|model`, `<end_of_turn>`; no system role: a system prompt opens the first user
turn), tool calls as a Python list of calls (vLLM's `pythonic` parser), results in a user turn's
`<tool_response>`. The templates are written here, in each
family's format (no hub to fetch them from); `FORMATS` holds them with their special tokens.

Invariants the rest of Flywheel relies on (qwen2's names; each family has its own):
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

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# A tool as the model reads it: its signature (name, description, parameters), not the API's flags
# about it: the Agents SDK sends `"strict": false` on every function, which a model trained on the
# bare signature has never seen (the bootstrap's base answered 1.5% through the SDK agent, 35-38% without the flag)
TOOL_SIGNATURE = """{% set sig = tool.function if tool.function is defined else tool %}\
{"name": {{ sig.name | tojson }}\
{%- if sig.description is defined %}, "description": {{ sig.description | tojson }}{% endif %}\
{%- if sig.parameters is defined %}, "parameters": {{ sig.parameters | tojson }}{% endif %}}"""

HERMES_CALLS = """{% if m.content %}{{ m.content }}{% endif %}\
{%- for tc in (m.tool_calls or []) %}{% set f = tc.function if tc.function is defined else tc %}\
{%- if loop.index0 > 0 or m.content %}
{% endif %}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else (f.arguments | tojson) }}}
</tool_call>\
{%- endfor %}<|im_end|>
"""  # an assistant turn's content and tool calls, Hermes markup, to its <|im_end|>

CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}\
{%- else %}{% set system = 'You are a helpful assistant.' %}{% set rest = messages %}{% endif %}\
<|im_start|>system
{{ system }}{% if tools %}
<tools>
{% for tool in tools %}""" + TOOL_SIGNATURE + """
{% endfor %}</tools>{% endif %}<|im_end|>
{% for m in rest %}\
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
""" + HERMES_CALLS + """{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}\
{%- endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}\
{%- else %}{% set system = '' %}{% set rest = messages %}{% endif %}\
{%- if tools %}<|im_start|>system
{% if system %}{{ system }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}""" + TOOL_SIGNATURE + """
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}\
{%- set ns = namespace(last_user=-1) %}{% for m in rest %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}\
{%- for m in rest %}\
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if loop.index0 > ns.last_user and (loop.last or m.reasoning_content) %}<think>
{{ (m.reasoning_content or '') | trim }}
</think>

{% endif %}""" + HERMES_CALLS + """{% elif m.role == 'tool' %}{% if loop.first or rest[loop.index0 - 1].role != 'tool' %}<|im_start|>user{{ '\\n' }}{% endif %}\
<tool_response>
{{ m.content }}
</tool_response>{% if loop.last or rest[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}\
{%- endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant
{% if not enable_thinking is defined or not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

LLAMA_TEMPLATE = """\
{{- bos_token }}\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content | trim %}{% set rest = messages[1:] %}\
{%- else %}{% set system = '' %}{% set rest = messages %}{% endif %}\
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}Cutting Knowledge Date: December 2023

{% if tools %}You have access to the following functions. To call a function, please respond with JSON for a \
function call. Respond in the format {"name": function name, "parameters": dictionary of argument name and its \
value}. Do not use variables.

{% for tool in tools %}""" + TOOL_SIGNATURE + """

{% endfor %}{% endif %}{{ system }}<|eot_id|>\
{%- for m in rest %}\
{%- if m.role == 'assistant' and m.tool_calls %}{% set f = m.tool_calls[0].function %}\
<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ f.name }}", "parameters": {{ f.arguments if f.arguments is string else (f.arguments | tojson) }}}<|eot_id|>\
{%- elif m.role == 'tool' or m.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>\
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content | trim }}<|eot_id|>\
{%- endif %}\
{%- endfor %}\
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral's format (the Hugging Face template of Mistral Small 3.1, tools the v3 way): a system
# prompt in [SYSTEM_PROMPT], the tools as JSON in [AVAILABLE_TOOLS] before the last user message,
# [INST]...[/INST] around a user message, no generation prompt, calls as a JSON array after
# [TOOL_CALLS] (read by vLLM's `mistral` parser; the tokenizer has no [ARGS], so its pre-v11 JSON
# form), each with the last 9 characters of its id, results in [TOOL_RESULTS] with their call's id.
# Only an assistant turn ends in </s>: the other messages end in their closing tag.
MISTRAL_TEMPLATE = """\
{{- bos_token }}\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}\
{%- else %}{% set system = '' %}{% set rest = messages %}{% endif %}\
{%- if system %}[SYSTEM_PROMPT]{{ system }}[/SYSTEM_PROMPT]{% endif %}\
{%- set ns = namespace(last_user=-1) %}{% for m in rest %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}\
{%- for m in rest %}\
{%- if m.role == 'user' %}\
{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS] [\
{%- for tool in tools %}{"type": "function", "function": """ + TOOL_SIGNATURE + """}{% if not loop.last %}, {% endif %}{% endfor %}\
][/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]\
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [\
{%- for tc in m.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}\
{"name": {{ f.name | tojson }}, "arguments": {{ f.arguments if f.arguments is string else (f.arguments | tojson) }}, \
"id": {{ ((tc.id or '') | string)[-9:] | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]</s>\
{%- elif m.role == 'assistant' %}{{ m.content }}</s>\
{%- elif m.role == 'tool' %}[TOOL_RESULTS] {"content": {{ m.content }}, \
"call_id": {{ ((m.tool_call_id or '') | string)[-9:] | tojson }}}[/TOOL_RESULTS]\
{%- endif %}\
{%- endfor %}"""

# Gemma 3's format with tools the way vLLM's example template for it does them (pythonic calls):
# no system role (a system prompt and the tools open the first user turn), the assistant is `model`,
# a call is `[name(key=value, ...)]` with JSON values (arguments must arrive as a mapping: vLLM parses
# a request's argument strings before rendering, and so does rollout.chat), a tool result is a user
# turn in <tool_response>. Every turn ends in <end_of_turn>.
GEMMA_TEMPLATE = """\
{{- bos_token }}\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}\
{%- else %}{% set system = '' %}{% set rest = messages %}{% endif %}\
{%- for m in rest %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}
{% if loop.first %}{% if system %}{{ system | trim }}

{% endif %}{% if tools %}Tools (functions) are available. If you decide to invoke one or more of the tools, you must \
respond with a python list of the function calls.
Example Format: [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]
Here is a list of functions in JSON format that you can invoke.
[{% for tool in tools %}""" + TOOL_SIGNATURE + """{% if not loop.last %}, {% endif %}{% endfor %}]

{% endif %}{% endif %}\
{%- if m.role == 'assistant' and m.tool_calls %}[\
{%- for tc in m.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}{{ f.name }}(\
{%- for k, v in f.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %})\
{%- if not loop.last %}, {% endif %}{% endfor %}]\
{%- elif m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>\
{%- else %}{{ m.content | trim }}{% endif %}<end_of_turn>
{% endfor %}\
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


@dataclass(frozen=True)
class ChatFormatSpec:
    """A family's chat format: its template and the tokens the template and the model need."""
    template: str
    special: tuple[str, ...]  # special tokens (the BPE never splits them; decoding keeps them)
    added: tuple[str, ...]  # markup tokens kept whole and decoded as text (tool-call tags)
    eos: str  # the end-of-turn token: an assistant turn ends in it
    pad: str
    bos: str | None = None  # rendered by the template itself, never added by the tokenizer


FORMATS = {
    "qwen2": ChatFormatSpec(CHAT_TEMPLATE, tuple(SPECIAL_TOKENS), tuple(TOOL_TOKENS), "<|im_end|>", "<|endoftext|>"),
    "qwen3": ChatFormatSpec(QWEN3_TEMPLATE, tuple(SPECIAL_TOKENS), tuple(TOOL_TOKENS) + ("<think>", "</think>"),
                            "<|im_end|>", "<|endoftext|>"),
    "llama": ChatFormatSpec(LLAMA_TEMPLATE, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                             "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"), (),
                            "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>"),
    "mistral": ChatFormatSpec(MISTRAL_TEMPLATE, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                                 "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                                 "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"), (),
                              "</s>", "<unk>", "<s>"),
    "gemma": ChatFormatSpec(GEMMA_TEMPLATE, ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), (),
                            "<end_of_turn>", "<pad>", "<bos>"),
}


def train_tokenizer(texts: Iterable[str], vocab_size: int, family: str = "qwen2") -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[0-9+\-*/()]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    fmt = FORMATS[family]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fmt.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if fmt.added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fmt.added])
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int, family: str = "qwen2"):
    """Wrap in a transformers fast tokenizer with the family's chat template; save it to `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    fmt = FORMATS[family]
    named = {fmt.eos, fmt.pad} | ({fmt.bos} if fmt.bos else set())
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=fmt.eos,
        pad_token=fmt.pad,
        **({"bos_token": fmt.bos} if fmt.bos else {}),
        additional_special_tokens=[t for t in fmt.special if t not in named],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = fmt.template
    hf.save_pretrained(str(out_dir))
    return hf


def render_texts(conversations: list[list[dict]], tools: list[dict], family: str = "qwen2") -> list[str]:
    """Render conversations with the family's template before any tokenizer exists (to train one)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from rollout.messages import mapping_arguments

    fmt = FORMATS[family]
    rendered, _ = render_jinja_template(conversations=[mapping_arguments(c) for c in conversations], tools=tools, chat_template=fmt.template,
                                        bos_token=fmt.bos or "")
    return rendered
