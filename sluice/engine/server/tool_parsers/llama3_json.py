"""The Llama 3.x JSON tool-call format: the whole output is one or more JSON objects
`{"name": ..., "parameters": {...}}` (or "arguments"), separated by `;`, optionally
after the `<|python_tag|>` token.

An output that starts (after whitespace) with `{` or the tag is held back until it
ends, then parsed whole: if every object is a call, the output is those calls and no
content; otherwise it is all content, as written. Any other output is content,
streamed as it comes (vLLM's rule).
"""

from __future__ import annotations

import json

from sluice.engine.server.tool_parsers.base import (
    Event,
    ParsedToolCall,
    ToolParser,
    call_from_object,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "text"; "calls"

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [text] if text else []
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []  # only whitespace, or maybe the tag still arriving
            self._mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "text"
            if self._mode == "text":
                out, self._buf = [self._buf], ""
                return out
        return []

    def finish(self) -> list[Event]:
        text, self._buf = self._buf, ""
        calls = _calls(text) if self._mode == "calls" else None
        if calls is not None:
            return list(calls)
        return [text] if text else []


def _calls(text: str) -> list[ParsedToolCall] | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = call_from_object(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
    return calls or None
