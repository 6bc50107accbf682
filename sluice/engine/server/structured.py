"""A request's structured-output constraint, from whichever field asks for one.

Three fields can: OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object), and a chat
request's required or named `tool_choice` (`tools.py` gives the schema). At most one
may: two constraints on one output are a 400, not a silent pick. The constraint is
compiled on a worker thread before the request is queued (`compile_constraint`), so
an invalid one is a 400 naming the problem and the engine thread finds it compiled.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sluice.engine.server.errors import RequestError
from sluice.engine.server.protocol_extras import ResponseFormat, StructuredOutputsField
from sluice.engine.structured_output.manager import StructuredOutputManager
from sluice.engine.structured_output.params import StructuredOutputsParams


def requested_constraint(response_format: ResponseFormat | None,
                         structured_outputs: StructuredOutputsField | None,
                         tool_schema: dict[str, Any] | None = None
                         ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field that asked for it), or (None, None)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if response_format is not None and response_format.type != "text":
        found.append((_from_response_format(response_format), "response_format"))
    if structured_outputs is not None:
        found.append((_from_structured_outputs(structured_outputs), "structured_outputs"))
    if tool_schema is not None:
        found.append((StructuredOutputsParams.from_schema(tool_schema), "tool_choice"))
    if len(found) > 1:
        names = " and ".join(name for _, name in found)
        raise RequestError(f"{names} each constrain the output; a request may use only one",
                           found[1][1])
    return found[0] if found else (None, None)


async def compile_constraint(manager: StructuredOutputManager,
                             params: StructuredOutputsParams | None, param: str | None) -> None:
    """Compile `params` (cached) off the event loop; RequestError (400) if it does not."""
    if params is None:
        return
    try:
        await asyncio.to_thread(manager.compile, params)
    except ValueError as exc:  # InvalidGrammarError, or no tokenizer
        raise RequestError(str(exc), param) from exc


def _from_response_format(rf: ResponseFormat) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise RequestError('response_format of type "json_schema" needs '
                           "json_schema.schema", "response_format")
    return StructuredOutputsParams.from_schema(rf.json_schema.json_schema)


def _from_structured_outputs(so: StructuredOutputsField) -> StructuredOutputsParams:
    schema = so.json_
    try:
        if schema is not None and not isinstance(schema, str):
            schema = StructuredOutputsParams.from_schema(schema).json
        return StructuredOutputsParams(
            json=schema, regex=so.regex, choice=None if so.choice is None else tuple(so.choice),
            grammar=so.grammar, json_object=bool(so.json_object),
            disable_any_whitespace=so.disable_any_whitespace)
    except ValueError as exc:
        raise RequestError(str(exc), "structured_outputs") from exc
