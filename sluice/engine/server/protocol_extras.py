"""The typed parts of OpenAI / vLLM request bodies beyond plain sampling numbers: tools and
tool_choice, response_format, vLLM's structured_outputs, stream_options.

Strict like `protocol.py` (no coercion). Objects whose every field Sluice reads are
closed (extra="forbid": an unknown key is a 400 naming it, never silently ignored);
a tool's definition stays open, since chat templates may read fields of their own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_CLOSED = ConfigDict(strict=True, extra="forbid")
_OPEN = ConfigDict(strict=True, extra="allow")
MAX_CHOICES = 1024  # structured_outputs.choice strings


class KVTransferParamsField(BaseModel):
    """vLLM's `kv_transfer_params` (disaggregated prefill/decode; kv_transfer/params.py).
    Closed: a foreign key is a 400 naming it."""

    model_config = _CLOSED

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = Field(default=None, max_length=256)
    remote_block_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(
        default=None, max_length=1 << 20, fail_fast=True)
    remote_host: str | None = Field(default=None, max_length=256)
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    remote_request_id: str | None = Field(default=None, max_length=256)
    tp_size: int | None = Field(default=None, ge=1)
    lora_name: str | None = Field(default=None, max_length=256)  # the prefill's adapter


class StreamOptions(BaseModel):
    model_config = _CLOSED

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class FunctionDefinition(BaseModel):
    model_config = _OPEN

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _OPEN

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = _CLOSED

    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call exactly this function."""

    model_config = _CLOSED

    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    model_config = _CLOSED

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object.

    disable_fallback and disable_additional_properties are accepted and moot here:
    there is one backend (nothing to fall back to), and xgrammar's strict mode already
    forbids properties a schema does not name."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES, fail_fast=True)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
