"""OpenAI chat messages as chat templates want them. Standard library only: a leaf any layer may
import (the bootstrap renders demonstrations with it before any tokenizer exists)."""

from __future__ import annotations

import json


def mapping_arguments(messages: list[dict]) -> list[dict]:
    """`messages` with each tool call's arguments a mapping where the OpenAI API sends a JSON string:
    what vLLM's server renders (it parses them before applying the template), and what a template
    that writes the arguments one by one (Gemma's `[f(key=value)]`) needs. Unparsable ones stay."""

    def parsed(call: dict) -> dict:
        f = call.get("function", call)
        if not isinstance(f.get("arguments"), str):
            return call
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            return call
        if not isinstance(args, dict):
            return call
        return {**call, "function": {**f, "arguments": args}} if "function" in call else {**call, "arguments": args}

    return [{**m, "tool_calls": [parsed(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
