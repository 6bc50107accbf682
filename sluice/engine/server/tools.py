"""A chat request's tools and tool_choice, as vLLM serves them.

- none: tools reach the chat template, the answer is plain content;
- auto (the default when tools are given): the model may call tools in its own
  format, which the server's --tool-call-parser finds (400 without one, as vLLM);
- required: structured outputs force vLLM's JSON array of calls,
  `[{"name": one of the tools, "parameters": its parameter schema}, ...]`
  (at most one element with parallel_tool_calls false);
- a named function: structured outputs force that function's parameter schema, and
  the whole output is its arguments.

finish_reason is "tool_calls" when auto found calls, or when required ended
normally; a named call keeps the engine's reason (OpenAI and vLLM answer "stop").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.engine.server.errors import RequestError
from sluice.engine.server.protocol import ChatCompletionRequest
from sluice.engine.server.protocol_extras import NamedToolChoice, Tool
from sluice.engine.server.tool_calls import (
    NamedToolCallStream,
    RequiredToolCallsParser,
    ToolCallStream,
)
from sluice.engine.server.tool_parsers import TOOL_PARSERS, ToolParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSetup:
    """How one chat request's tools shape its generation and its answer."""

    mode: str  # "plain" | "auto" | "required" | "named"
    schema: dict[str, Any] | None = None  # the grammar of required / named
    parser: type[ToolParser] | None = None  # auto
    function_name: str | None = None  # named
    parallel: bool = True

    def stream(self) -> ToolCallStream:
        """A fresh stream for one choice."""
        if self.mode == "named":
            assert self.function_name is not None
            return NamedToolCallStream(self.function_name)
        if self.mode == "required":
            return ToolCallStream(RequiredToolCallsParser())
        if self.mode == "auto":
            assert self.parser is not None
            return ToolCallStream(self.parser(), None if self.parallel else 1)
        return ToolCallStream(None)

    @property
    def skip_special_tokens(self) -> bool | None:
        """An override of the request's skip_special_tokens (None: keep it)."""
        if self.mode == "auto" and self.parser is not None and not self.parser.skip_special_tokens:
            return False
        return None

    def finish_reason(self, stream: ToolCallStream, reason: str | None) -> str | None:
        if stream.tools_called and (self.mode == "auto" or
                                    (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason


def tool_setup(body: ChatCompletionRequest, parser_name: str | None) -> ToolSetup:
    """The request's tool mode; RequestError (400) for an inconsistent request."""
    choice, tools = body.tool_choice, body.tools
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolSetup("plain")
    if tools is None:
        raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required" and not tools:
        return ToolSetup("plain")  # OpenAI's behaviour for an empty list
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise RequestError("The tool specified in `tool_choice` does not match any of "
                               f"the specified `tools` (no function named {name!r})",
                               "tool_choice")
        return ToolSetup("named", tool.function.parameters or EMPTY_PARAMETERS,
                         function_name=name)
    if choice == "required":
        return ToolSetup("required", required_schema(tools, body.parallel_tool_calls),
                         parallel=body.parallel_tool_calls)
    if parser_name is None:
        raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set (tools without a tool_choice mean "
                           '"auto"; send tool_choice "none", "required" or a named '
                           "function, or start the server with a parser)", "tool_choice")
    return ToolSetup("auto", parser=TOOL_PARSERS[parser_name],
                     parallel=body.parallel_tool_calls)


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for `required`: an array of {name, parameters} of the given tools, with
    every tool's `$defs` lifted to the top (a name defined twice differently is a 400)."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        params = dict(tool.function.parameters or EMPTY_PARAMETERS)
        for def_name, def_schema in (params.pop("$defs", None) or {}).items():
            if defs.get(def_name, def_schema) != def_schema:
                raise RequestError(f"Tool definition {def_name!r} has multiple schemas, "
                                   "which is not supported.", "tools")
            defs[def_name] = def_schema
        alternatives.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": params},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
