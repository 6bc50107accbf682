"""One chat choice's output as OpenAI message parts: content and tool_calls, streamed or whole.

A `ToolCallStream` turns the choice's text deltas into `ChatDelta`s: content text and
tool-call deltas in the shape the OpenAI SDK assembles (the first delta of a call
carries its index, id, type and name; later ones add to its arguments). The full
(non-streamed) answer is the same stream run over the whole text and merged
(`merge`), so both forms always agree. Modes (`tools.py` picks one):

- plain: everything is content (no tools, or tool_choice none);
- named: the whole output is the arguments of the one named function (its grammar
  is the function's parameter schema), streamed as it comes;
- required: the output is vLLM's JSON array `[{"name": ..., "parameters": {...}}]`
  (its grammar enforces it); each element becomes a call when it closes;
- auto: a tool-call parser (`tool_parsers/`) finds calls in free text.

Whitespace right before a tool call, and at the end of a message with calls (the
newlines models put around them), is dropped; content is held back only while it is
such whitespace. A message whose content ends up empty has content null.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from sluice.engine.server.tool_parsers import Event, ParsedToolCall, ToolParser


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


@dataclass
class ToolCallDelta:
    index: int
    arguments: str = ""
    id: str | None = None  # set on a call's first delta, with name
    name: str | None = None

    def to_json(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function: dict = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass
class ChatDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStream:
    """One choice's parts, from events of a parser (str content | ParsedToolCall)."""

    def __init__(self, parser: ToolParser | None, max_calls: int | None = None) -> None:
        """`parser` None: plain text. `max_calls`: calls past it are dropped
        (parallel_tool_calls false)."""
        self.parser = parser
        self.max_calls = max_calls
        self.num_calls = 0
        self._held = ""  # trailing whitespace of the content, kept until we know what follows

    @property
    def tools_called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> ChatDelta:
        if self.parser is None:
            return ChatDelta(text)
        return self._deltas(self.parser.feed(text), final=False)

    def finish(self) -> ChatDelta:
        if self.parser is None:
            return ChatDelta()
        return self._deltas(self.parser.finish(), final=True)

    def _deltas(self, events: list[Event], final: bool) -> ChatDelta:
        out = ChatDelta()
        for event in events:
            if isinstance(event, str):
                body = event.rstrip()
                if body:
                    out.content += self._held + body
                    self._held = ""
                self._held += event[len(body):]
                continue
            self._held = ""  # whitespace before a call: dropped
            if self.max_calls is not None and self.num_calls >= self.max_calls:
                continue
            out.tool_calls.append(ToolCallDelta(self.num_calls, event.arguments,
                                                tool_call_id(), event.name))
            self.num_calls += 1
        if final and not self.tools_called:
            out.content += self._held
            self._held = ""
        return out


class NamedToolCallStream(ToolCallStream):
    """The output is the arguments of `name`: one call, streamed as it comes."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    def feed(self, text: str) -> ChatDelta:
        if self.num_calls == 0:
            self.num_calls = 1
            return ChatDelta(tool_calls=[ToolCallDelta(0, text, tool_call_id(), self.name)])
        return ChatDelta(tool_calls=[ToolCallDelta(0, text)] if text else [])


class RequiredToolCallsParser(ToolParser):
    """vLLM's `required` output, `[{"name": str, "parameters": {...}}, ...]`: each element
    is a call once its closing brace arrives. An element cut short (the length limit)
    is content, as written."""

    name = "required"

    def __init__(self) -> None:
        self._buf = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item_start: int | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        base = len(self._buf)
        self._buf += text
        for k, c in enumerate(text, base):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if self._depth == 2 and c == "{":
                    self._item_start = k
            elif c in "]}":
                if self._depth == 2 and c == "}" and self._item_start is not None:
                    out.append(_required_item(self._buf[self._item_start:k + 1]))
                    self._item_start = None
                self._depth -= 1
        return out

    def finish(self) -> list[Event]:
        tail = "" if self._item_start is None else self._buf[self._item_start:]
        self._buf, self._item_start = "", None
        return [tail] if tail else []


def _required_item(text: str) -> Event:
    try:
        obj = json.loads(text)
    except ValueError:
        return text
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return text
    return ParsedToolCall(obj["name"], json.dumps(obj.get("parameters", {}), ensure_ascii=False))


def merge(deltas: list[ChatDelta]) -> tuple[str | None, list[dict]]:
    """A whole message's content (None when empty) and tool_calls (OpenAI's JSON)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_calls:
            if t.index not in calls:
                calls[t.index] = {"id": t.id, "type": "function",
                                  "function": {"name": t.name, "arguments": ""}}
            calls[t.index]["function"]["arguments"] += t.arguments
    return content or None, [calls[i] for i in sorted(calls)]
