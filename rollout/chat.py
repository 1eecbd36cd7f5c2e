"""An agent conversation on token ids, for any chat template and any tool-call format vLLM parses.

    chat = ChatFormat.of(tokenizer, task.tools)  # what this tokenizer's template and tool format do
    ids = chat.prompt(messages)                  # the conversation + the generation prompt, as ids
    msg = chat.parse(text)                       # a sampled turn -> an OpenAI assistant message
    ids += sampled + chat.after_turn(messages)   # messages end in [assistant, tool...]: the tool
                                                 # results and the next generation prompt, as ids
    chat.messages(text)                          # a rendered conversation -> OpenAI messages

Nothing a model sampled is ever re-tokenized: the tokens after an assistant's end-of-turn token are
the template's own rendering of what follows it (two renders, the second minus the first; the
template must render the history the same way both times, or `TemplateError` says where not).
Tool calls are parsed by vLLM's own parser for the family (`hermes` for ChatML/Qwen, `llama3_json`
for Llama 3, `mistral`, `pythonic` for Gemma 3, ...), the one `loop serve` passes
`--tool-call-parser`: the collector and an outside agent on the endpoint read the same calls.
`tool_parser_for(template)` picks it from the template where the markup says which; anything else
is the config's to name.

`messages(text)` inverts the template without knowing it: rendering one message of each role
around a sentinel gives that role's framing (what precedes and follows the content), and a rendered
conversation is split on those framings. Where every message ends in the end-of-turn token (ChatML,
Llama 3, Gemma) a framing runs from one to the next; where only assistant turns do (Mistral), it is
what rendering the message adds to the conversation before it, and a call id the template renders
matches any id. Tool-call arguments reach the template as a mapping, as vLLM's server passes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

from rollout.messages import mapping_arguments

SENTINEL = "QQSENTINELQQ"
CALL_ID = "QQCALLIDQ"  # nine characters: Mistral renders the last nine of an id
_CALL = {"id": CALL_ID, "type": "function", "function": {"name": "f", "arguments": "{}"}}  # framings' sentinel call
_CACHE: dict[tuple, tuple[object, "ChatFormat"]] = {}


class TemplateError(ValueError):
    """The tokenizer's chat template cannot play token-in/token-out episodes (said why)."""


def read_chat_template(folder) -> str | None:
    """A Hugging Face folder's chat template: chat_template.jinja, else tokenizer_config.json's."""
    import json
    from pathlib import Path

    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        t = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(t, list):  # named templates: the default one
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def tool_parser_for(template: str | None) -> str | None:
    """vLLM's tool parser for the tool-call markup a chat template renders, or None (unknown)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"  # Hermes, Qwen2/2.5/3 (vLLM aliases qwen to it)
    if "[func_name1(" in template:
        return "pythonic"  # the format line of vLLM's pythonic templates (Llama 3.2, Gemma 3)
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    return None


@dataclass
class ChatFormat:
    tokenizer: object
    tools: list[dict] | None
    parser_name: str | None  # vLLM's tool parser; None: the template has no tool-call markup known here
    _parser: object = field(default=None, repr=False)
    _request: object = field(default=None, repr=False)
    _framing: dict | None = field(default=None, repr=False)

    @classmethod
    def of(cls, tokenizer, tools: list[dict] | None, parser: str | None = None) -> "ChatFormat":
        """The format of `tokenizer` (its own chat template) for a conversation offering `tools`
        (a task's, rendered into every prompt; None: none), tool calls read by `parser` (None:
        picked from the template). Cached per tokenizer and tools."""
        key = (id(tokenizer), parser, id(tools))
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise TemplateError("the tokenizer has no chat template")
        name = parser or tool_parser_for(template)
        if tokenizer.eos_token_id is None:
            raise TemplateError("the tokenizer has no eos token: an assistant turn must end in one")
        fmt = cls(tokenizer, tools, name)
        _CACHE[key] = (tokenizer, fmt)
        return fmt

    # -- rendering ----------------------------------------------------------------------------
    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(mapping_arguments(messages), tools=self.tools,
                                                  add_generation_prompt=generation_prompt, tokenize=False)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.ids(self.render(messages, True))

    @cached_property
    def eot(self) -> str:
        return self.tokenizer.decode([self.tokenizer.eos_token_id], skip_special_tokens=False)

    def after_turn(self, messages: list[dict]) -> list[int]:
        """Ids after the last assistant message's end-of-turn token: what follows it in `messages`
        (tool results) and the next generation prompt. Read off the template's rendering of the
        whole conversation after the same number of end-of-turn tokens, so a template that renders
        past turns differently once others follow (Qwen3 drops their empty think blocks) still
        gives the right continuation; the tokens before it are the ones sampled, never re-rendered."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ValueError("after_turn needs an assistant message")
        turns = self.render(messages[:last + 1], False).count(self.eot)
        after = self.render(messages, True)
        cut = -len(self.eot)
        for _ in range(turns):
            cut = after.find(self.eot, cut + len(self.eot))
            if cut < 0:
                raise TemplateError(f"the template renders fewer end-of-turn tokens {self.eot!r} once a tool "
                                    "result follows the assistant turn")
        return self.ids(after[cut + len(self.eot):])

    def assistant_text(self, messages: list[dict]) -> str:
        """How the template renders the last message (an assistant's) after the generation prompt,
        through its end-of-turn token: what a demonstration teaches the model to sample."""
        head = self.render(messages[:-1], True)
        full = self.render(messages, False)
        if not full.startswith(head):
            raise TemplateError("the template renders an assistant turn differently from its generation prompt")
        body = full[len(head):]
        end = body.find(self.eot)
        if end < 0:
            raise TemplateError(f"the template renders no end-of-turn token {self.eot!r} after an assistant message")
        return body[:end + len(self.eot)]

    # -- parsing ------------------------------------------------------------------------------
    def parse(self, text: str) -> dict:
        """A sampled assistant turn (its end-of-turn token stripped) as an OpenAI message, its calls
        read by vLLM's parser. Malformed markup is content, with no call (as the endpoint says);
        with no parser (a template without tool markup) all of it is content."""
        if self.parser_name is None:
            return {"role": "assistant", "content": text.strip(), "tool_calls": None}
        if self._parser is None:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.tool_parsers import ToolParserManager

            self._parser = ToolParserManager.get_tool_parser(self.parser_name)(self.tokenizer)
            self._request = ChatCompletionRequest(model="flywheel", messages=[{"role": "user", "content": "-"}],
                                                  tools=self.tools)
        quiet = logging.getLogger("vllm.tool_parsers")
        level, quiet.level = quiet.level, logging.CRITICAL  # a malformed call logs a traceback each time
        try:
            out = self._parser.extract_tool_calls(text, self._request)
        finally:
            quiet.level = level
        calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for i, c in enumerate(out.tool_calls)] if out.tools_called else []
        content = (out.content or "").strip() if calls else text.strip()
        return {"role": "assistant", "content": content, "tool_calls": calls or None}

    def framing(self) -> dict[str, list[tuple[str, str]]]:
        """role -> [(what the template puts before a message's content, what after it)], learned by
        rendering sentinel messages. The assistant's has the generation prompt's too: a sampled turn
        follows that one. A call id the template renders reads as `CALL_ID` (any id matches it)."""
        if self._framing is None:
            self._framing = self._framing_by_eot() or self._framing_by_renders()
        return self._framing

    def _framing_by_eot(self) -> dict | None:
        """Where every message ends in the end-of-turn token (ChatML, Llama 3, Gemma): a message's framing
        runs from the end-of-turn token before it through the one after it. None where one does not.
        A template with no system turn (Gemma) puts a system prompt at the start of the first user
        turn: it reads back as a system message where the tools block stands between it and the
        user's text, and the user's text then has no opening of its own; without tools it is part of
        the user's message, as the model saw it."""
        s, eot = SENTINEL, self.eot
        convo = [{"role": "system", "content": s + "S"}, {"role": "user", "content": s + "U"},
                 {"role": "assistant", "content": s + "A"}, {"role": "user", "content": s + "V"},
                 {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                 {"role": "tool", "tool_call_id": CALL_ID, "content": s + "T"}]
        text = self.render(convo, False)
        out: dict[str, list[tuple[str, str]]] = {}
        folded = None
        for role, tag in (("system", "S"), ("user", "V"), ("assistant", "A"), ("tool", "T")):
            at = text.find(s + tag)
            start = text.rfind(eot, 0, at)
            start = 0 if start < 0 else start + len(eot)
            close, nxt = text.find(eot, at), text.find(s, at + len(s))
            if role == "system" and 0 <= nxt < close:
                folded = (text[start:at], text[at + len(s) + 1:nxt])
                continue  # no system turn: a system prompt opens the first user turn (Gemma)
            if close < 0 or 0 <= nxt < close:
                return None  # this message runs into the next one without an end-of-turn token
            out[role] = [(text[start:at], text[at + len(s) + 1:close + len(eot)])]
        if folded and folded[1].strip():  # what stands between it and the user's text (the tools) marks its end
            first = self.render(convo[1:2], False)  # the first user turn with no system prompt before it
            out["system"] = [folded]
            out["user"] += [(first[:first.find(s)], out["user"][0][1]), ("", out["user"][0][1])]
        head = self.render(convo[:4], False)
        gen = self.render(convo[:4], True)[len(head):]
        out["assistant"].append((head[head.rfind(eot) + len(eot):] + gen, eot))
        return out

    def _framing_by_renders(self) -> dict[str, list[tuple[str, str]]]:
        """Where only the assistant's turns end in the end-of-turn token (Mistral: [INST]...[/INST],
        [TOOL_RESULTS]...[/TOOL_RESULTS]): each message of an episode-shaped conversation is what
        rendering it adds to the conversation before it, with and without tools (a template may
        put them before the last user message only). An assistant turn that the template gives no
        opening (no generation prompt) has the empty one: it starts where the message before ended."""
        s = SENTINEL
        convo = [{"role": "system", "content": s + "S"}, {"role": "user", "content": s + "U"},
                 {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                 {"role": "tool", "tool_call_id": CALL_ID, "content": s + "T"},
                 {"role": "assistant", "content": s + "A"}]
        out: dict[str, list[tuple[str, str]]] = {}
        def render(msgs, gen, tools):
            return self.tokenizer.apply_chat_template(mapping_arguments(msgs), tools=tools, add_generation_prompt=gen,
                                                      tokenize=False) if msgs else ""
        for tools in (self.tools, None):
            for k, m in enumerate(convo):
                if s not in m["content"]:
                    continue
                before = render(convo[:k], m["role"] == "assistant", tools)
                upto = render(convo[:k + 1], False, tools)
                if not upto.startswith(before):
                    raise TemplateError(f"the template renders the conversation before a {m['role']} message "
                                        "differently once that message follows")
                piece = upto[len(before):]
                at = piece.find(s)
                gen = before[len(render(convo[:k], False, tools)):] if m["role"] == "assistant" else ""
                pair = (gen + piece[:at], piece[at + len(s) + 1:])
                if pair not in out.setdefault(m["role"], []):
                    out[m["role"]].append(pair)
        return out

    def messages(self, text: str) -> list[dict]:
        """A rendered conversation (as the model saw it) as OpenAI messages: the next message is
        the framing that starts first (the longest there), or, right after a message that is not
        an assistant's, an assistant turn the template opens with nothing (Mistral), or, right
        after a system prompt, the user text it opens (Gemma); text before it that no framing
        reads is skipped. An assistant turn cut off before its end-of-turn token runs to the end."""
        candidates = sorted(((pre, post, role) for role, fs in self.framing().items() for pre, post in fs),
                            key=lambda c: -len(c[0]))
        bare = next((c for c in candidates if not c[0]), None)  # a role the template opens with nothing
        out, pos = [], 0
        while pos < len(text):
            found = [(*_find(text, pre, pos), i) for i, (pre, _, _) in enumerate(candidates) if pre]
            found = sorted((at, i, start) for at, start, i in found if at >= 0)
            follows = bare and out and out[-1]["role"] != bare[2] and (bare[2] != "user" or out[-1]["role"] == "system")
            if follows and (not found or found[0][0] > pos):
                (pre, post, role), start = bare, pos
            elif found:
                _, i, start = found[0]  # earliest; among equal starts the longest framing (sorted first)
                pre, post, role = candidates[i]
            else:
                break
            end, after = _find(text, post, start)
            body = text[start:end if end >= 0 else len(text)]
            pos = after if end >= 0 else len(text)
            if role == "assistant":
                out.append(self.parse(body))
            else:
                out.append({"role": role, "content": body.strip() if role == "system" else body})
        return out


def _find(text: str, pattern: str, start: int) -> tuple[int, int]:
    """(where `pattern` starts in `text` at or after `start`, where it ends), `CALL_ID` in it matching
    any call id; (-1, -1) if it is not there."""
    head, sep, tail = pattern.partition(CALL_ID)
    at = text.find(head, start)
    if at < 0 or not sep:
        return at, (at + len(head) if at >= 0 else -1)
    end = text.find(tail, at + len(head))
    return (at, end + len(tail)) if end >= 0 else (-1, -1)


def encode_demo(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a demonstration as an episode of it is played, and a 0/1 mask of the
    assistant's tokens: the prompt, then each assistant turn as the template renders it after its
    generation prompt (through its end-of-turn token: the loss), then what follows it (tool
    results and the next generation prompt). So SFT trains on the very token sequences the
    collector builds, for any template, also one that renders past turns differently once others
    follow. What the full render has after the last turn is context.
    """
    chat = ChatFormat.of(tokenizer, tools)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("a demonstration needs an assistant turn")
    ids = chat.prompt(messages[:turns[0]])
    mask = [0] * len(ids)
    for k, nxt in zip(turns, turns[1:] + [None]):
        said = chat.ids(chat.assistant_text(messages[:k + 1]))
        if nxt is not None:
            after = chat.after_turn(messages[:nxt])
        else:
            text = chat.render(messages, False)
            after = chat.ids(text[text.rfind(chat.eot) + len(chat.eot):])
        ids += said + after
        mask += [1] * len(said) + [0] * len(after)
    return ids, mask
