"""OpenAI request bodies (the fields vLLM accepts that Sluice implements)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.chat_template import template_messages
from sluice.engine.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per prompt


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None

    def sampling_params(self, default_max_tokens: int, logprobs: int | None,
                        sample_index: int = 0, defaults: dict | None = None) -> SamplingParams:
        """Engine parameters for the sample_index-th of the n choices (seed + index).

        A field the request leaves out takes the model's default from `defaults`
        (generation_config.json, as vLLM's `--generation-config auto`), else OpenAI's.
        """
        d = defaults or {}

        def pick(value, name, fallback):
            return value if value is not None else d.get(name, fallback)

        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        max_tokens = self._max_tokens() or min(d.get("max_tokens", default_max_tokens),
                                               default_max_tokens)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0) or 0,
            min_p=pick(self.min_p, "min_p", 0.0),
            seed=None if self.seed is None else self.seed + sample_index,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    suffix: None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages for the chat template (`template_messages`: the gateway's too)."""
        return template_messages([m.model_dump(exclude_none=True) for m in self.messages])
