"""Tool-call parsers for `tool_choice: auto`, chosen with --tool-call-parser (vLLM's names)."""

from __future__ import annotations

from sluice.engine.server.tool_parsers.base import Event, ParsedToolCall, ToolParser
from sluice.engine.server.tool_parsers.hermes import HermesToolParser
from sluice.engine.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}

__all__ = ["TOOL_PARSERS", "Event", "ParsedToolCall", "ToolParser"]
