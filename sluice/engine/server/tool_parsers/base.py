"""What every tool-call parser shares: its streaming contract and the call object it yields.

A parser reads one choice's output text as it streams. `feed(text)` returns what the
text so far has decided, in output order: plain content (str) and complete tool calls
(ParsedToolCall); text that might still turn out to belong to a tool call is held
back. `finish()` returns the rest at the end of the output. Parsing the whole text at
once is `feed(text) + finish()`, so a streamed answer and a full one carry the same
content and calls. Malformed tool-call markup is never an error: it comes back as
content, exactly as the model wrote it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    """A complete call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


Event = str | ParsedToolCall


class ToolParser(ABC):
    """One choice's streaming parser (a new instance per choice)."""

    name: ClassVar[str]
    # Whether output text may drop special tokens: a parser whose markup is made of
    # special tokens needs them kept (vLLM's parsers adjust the request the same way).
    skip_special_tokens: ClassVar[bool] = True

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events the text so far decides (text may be "")."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Everything still held back, at the end of the output."""

    def parse(self, text: str) -> list[Event]:
        """The events of a whole output."""
        return self.feed(text) + self.finish()


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """`{"name": str, <argument key>: object | JSON text}` as a call; None if it is not one.

    Arguments given as an object are written as JSON (non-ASCII kept, as vLLM does);
    given as a string, they must be JSON text themselves; missing, they are `{}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ParsedToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
