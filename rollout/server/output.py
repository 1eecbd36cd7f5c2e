"""The assistant message a client received, rebuilt from the response bytes (JSON or SSE).

The trace's `output` column is what the client saw: vLLM's tool parser decides `tool_calls`, so
we read them from the response rather than re-parse the tokens.
"""

from __future__ import annotations

import json


class OutputParser:
    def __init__(self, chat: bool):
        self.chat = chat
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> None:
        if chunk:
            self._buf += chunk

    def result(self) -> tuple[dict, str | None, str | None]:
        """(assistant message, finish_reason, error message) of choice 0."""
        raw = bytes(self._buf)
        if raw.lstrip().startswith(b"data:"):
            return self._stream(raw)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return {}, None, raw[:500].decode("utf-8", "replace") or None
        if not isinstance(body, dict):
            return {}, None, None
        if "error" in body or "choices" not in body:
            return {}, None, _error_text(body)
        choice = next((c for c in body["choices"] if c.get("index", 0) == 0), None) or {}
        if self.chat:
            msg = choice.get("message") or {}
            out = {"content": msg.get("content")}
            if msg.get("tool_calls"):
                out["tool_calls"] = msg["tool_calls"]
        else:
            out = {"content": choice.get("text")}
        return out, choice.get("finish_reason"), None

    def _stream(self, raw: bytes) -> tuple[dict, str | None, str | None]:
        content, calls, finish, error = [], {}, None, None
        for event in raw.split(b"\n\n"):
            event = event.strip()
            if not event.startswith(b"data:"):
                continue
            data = event[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            if "error" in chunk:
                error = _error_text(chunk)
                continue
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                finish = choice.get("finish_reason") or finish
                if not self.chat:
                    content.append(choice.get("text") or "")
                    continue
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                                 "function": {"name": "", "arguments": ""}})
                    slot["id"] = tc.get("id") or slot["id"]
                    fn = tc.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
        out = {"content": "".join(content) or None}
        if calls:
            out["tool_calls"] = [calls[i] for i in sorted(calls)]
        return out, finish, error


def _error_text(body: dict) -> str | None:
    err = body.get("error", body)
    if isinstance(err, dict):
        return str(err.get("message") or err)[:2000]
    return str(err)[:2000]
