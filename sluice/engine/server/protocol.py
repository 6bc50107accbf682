"""OpenAI request bodies (the fields vLLM accepts that Sluice implements).

Every top-level field here is implemented; any other lands in `model_extra`, which
`unknown_fields.py` refuses (400) or logs. Nested objects are typed in
`protocol_extras.py`.

Strict types, no coercion (pydantic strict mode): `"5"` or `true` is not a
number, `1` is not a bool, `1.0` is not an int; only JSON integers widen to
floats. Integers the engine hands to torch are bounded to int64 (a larger one
would overflow inside the engine loop), and the lists it scans on every step
(stop strings, stop token ids) are bounded so one request cannot slow everyone.
Every list fails fast: pydantic otherwise reports one error per bad element
for each member of a union, and a 12 MB `"prompt": [true, true, ...]` took it
half a minute on the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.chat_template import template_messages
from sluice.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from sluice.engine.server.priority import MAX_PRIORITY
from sluice.engine.server.protocol_extras import (
    KVTransferParamsField,
    ResponseFormat,
    StreamOptions,
    StructuredOutputsField,
    Tool,
    ToolChoice,
)

MAX_N = 16  # choices per prompt
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 64  # checked against the new text on every step
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024  # added to the logits on every step
MAX_BAD_WORDS = 256  # matched against the output's tail on every step
MAX_BAD_WORD_CHARS = 256

_OPEN = ConfigDict(strict=True, extra="allow")  # undeclared fields: unknown_fields.py
_FAIL_FAST = Field(fail_fast=True)  # stop a list at its first bad element
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)]
PromptIds = Annotated[list[int], _FAIL_FAST]  # checked against the vocabulary later
Prompt = (str | Annotated[list[str], _FAIL_FAST] | PromptIds
          | Annotated[list[PromptIds], _FAIL_FAST])
JSONObjects = Annotated[list[dict[str, Any]], _FAIL_FAST]


class _SamplingFields(BaseModel):
    model_config = _OPEN

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # seed + choice index seeds a torch.Generator: int64, as vLLM bounds it.
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX - MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop: StopString | StopList | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS,
                                                 fail_fast=True)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # vLLM's: lower is served first (--scheduling-policy priority; server/priority.py)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        Field(default=None, max_length=MAX_LOGIT_BIAS_ENTRIES))
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = (
        Field(default=None, max_length=MAX_BAD_WORDS, fail_fast=True))
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, fail_fast=True)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    kv_transfer_params: KVTransferParamsField | None = None  # disaggregated prefill/decode

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) < 19):
                raise ValueError(f"keys are token ids written as strings; got {key!r}")
        return value

    def sampling_params(self, default_max_tokens: int, logprobs: int | None,
                        sample_index: int = 0, defaults: dict | None = None,
                        **derived: Any) -> SamplingParams:
        """Engine parameters for the sample_index-th of the n choices (seed + index).

        A field the request leaves out takes the model's default from `defaults`
        (generation_config.json, as vLLM's `--generation-config auto`), else OpenAI's.
        `derived`: SamplingParams fields the server worked out from the request
        (structured_outputs, bad_words_token_ids, ...); they win over the body's.
        """
        d = defaults or {}

        def pick(value, name, fallback):
            return value if value is not None else d.get(name, fallback)

        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        max_tokens = self._max_tokens() or min(d.get("max_tokens", default_max_tokens),
                                               default_max_tokens)
        fields = {
            "max_tokens": max_tokens,
            "temperature": pick(self.temperature, "temperature", 1.0),
            "top_p": pick(self.top_p, "top_p", 1.0),
            "top_k": pick(self.top_k, "top_k", 0) or 0,
            "min_p": pick(self.min_p, "min_p", 0.0),
            "seed": None if self.seed is None else self.seed + sample_index,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": pick(self.repetition_penalty, "repetition_penalty", 1.0),
            "stop": tuple(stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "min_tokens": self.min_tokens,
            "logit_bias": tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            "allowed_token_ids": (None if self.allowed_token_ids is None
                                  else tuple(self.allowed_token_ids)),
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "prompt_logprobs": self.prompt_logprobs,
        }
        return SamplingParams(**{**fields, **derived})

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion length the request asks for (None: fill the context) and its field."""
        return self._max_tokens(), "max_tokens"


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo (the prompt back)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    """Open: the template reads what it needs (tool_calls, tool_call_id, name, ...)."""

    model_config = _OPEN

    role: str
    content: str | JSONObjects | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[Tool] | None = Field(default=None, fail_fast=True)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages for the chat template (`template_messages`: the gateway's too)."""
        return template_messages([m.model_dump(exclude_none=True) for m in self.messages])

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the client sent them (the gateway renders those too)."""
        return None if self.tools is None else [t.model_dump(exclude_unset=True, by_alias=True)
                                                for t in self.tools]


class TokenizeCompletionRequest(BaseModel):
    """vLLM's `POST /tokenize` for text."""

    model_config = _OPEN
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's `POST /tokenize` for a chat: the template rendered as for a completion."""

    model_config = _OPEN
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: JSONObjects | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def message_dicts(self) -> list[dict[str, Any]]:
        return template_messages([m.model_dump(exclude_none=True) for m in self.messages])

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return self.tools


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`: token ids back to text."""

    model_config = _OPEN
    model: str | None = None
    tokens: list[TokenId] = Field(fail_fast=True)
