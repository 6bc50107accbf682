"""The Hermes tool-call format (Hermes 2 Pro, Qwen2.5, Qwen3, ...): each call is a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`,
text may come before, between and after the calls.

A block whose body is not such an object stays in the content, tags and all; an
unclosed block at the end of the output is parsed as if closed (vLLM does the same),
and kept as content if its body is not a call.
"""

from __future__ import annotations

import json

from sluice.engine.server.tool_parsers.base import (
    Event,
    ToolParser,
    call_from_object,
    partial_suffix,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    skip_special_tokens = False  # some Hermes vocabularies make the tags special tokens

    def __init__(self) -> None:
        self._buf = ""  # text not yet decided
        self._in_call = False  # _buf is the body of an open <tool_call> block

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_call:
                end = self._buf.find(END)
                if end < 0:
                    return out
                out.append(_block(self._buf[:end], closed=True))
                self._buf, self._in_call = self._buf[end + len(END):], False
                continue
            start = self._buf.find(START)
            if start < 0:
                emit = len(self._buf) - partial_suffix(self._buf, START)
                if emit:
                    out.append(self._buf[:emit])
                self._buf = self._buf[emit:]
                return out
            if start:
                out.append(self._buf[:start])
            self._buf, self._in_call = self._buf[start + len(START):], True

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._in_call:
            out.append(_block(self._buf, closed=False))
        elif self._buf:
            out.append(self._buf)
        self._buf, self._in_call = "", False
        return out


def _block(body: str, closed: bool) -> Event:
    try:
        call = call_from_object(json.loads(body), ("arguments",))
    except ValueError:
        call = None
    return call if call is not None else START + body + (END if closed else "")
