"""What the engine hands back to its callers after each step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its logprob and the top alternatives (token_id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it, its 1-based rank in the
    vocabulary, and the top (token_id, logprob) alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """The delta a request produced in one engine step.

    `new_text` is the detokenized text of `new_token_ids`, with stop strings
    already cut (and text that might still become a stop string held back until
    it is decided). When `finished` is true, `finish_reason` is one of
    "stop" | "length" | "abort" and no further outputs follow for this request.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None  # the first output only
    # a prefill leg's last output: where its held blocks are (kv_transfer/params.py)
    kv_transfer_params: dict[str, object] | None = None
