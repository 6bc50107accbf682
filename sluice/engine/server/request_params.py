"""What the server works out from a request before the engine sees it: the SamplingParams
fields that need the tokenizer, the vocabulary or the request's other fields.

`derived_fields` checks the token ids a request names (logit_bias keys,
allowed_token_ids) against the model's logits, tokenizes bad_words as vLLM does,
and sets the constraint, the prompt logprobs an echo needs and the special-token
handling a tool parser needs. Everything it refuses is a RequestError (400).
"""

from __future__ import annotations

from typing import Any

from sluice.engine.server.errors import RequestError
from sluice.engine.server.validation import check_ids_in_vocab
from sluice.engine.structured_output.params import StructuredOutputsParams


def derived_fields(body: Any, tokenizer, vocab_size: int,
                   constraint: StructuredOutputsParams | None = None,
                   skip_special_tokens: bool | None = None,
                   prompt_logprobs: int | None = None) -> dict[str, Any]:
    """Keyword arguments for `body.sampling_params(..., **derived)`."""
    derived: dict[str, Any] = {}
    if body.logit_bias:
        check_ids_in_vocab([int(k) for k in body.logit_bias], vocab_size, "logit_bias")
    check_ids_in_vocab(body.allowed_token_ids, vocab_size, "allowed_token_ids")
    if body.bad_words:
        if tokenizer is None:
            raise RequestError("bad_words need the model's tokenizer; this engine has none",
                               "bad_words")
        derived["bad_words_token_ids"] = bad_words_token_ids(tokenizer, body.bad_words,
                                                             vocab_size)
    if constraint is not None:
        derived["structured_outputs"] = constraint
    if skip_special_tokens is not None:
        derived["skip_special_tokens"] = skip_special_tokens
    if prompt_logprobs is not None:
        derived["prompt_logprobs"] = prompt_logprobs
    return derived


def bad_words_token_ids(tokenizer, words: list[str], vocab_size: int
                        ) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as encoded alone, and with a leading space when that makes a
    different first token of the same length (the word inside a sentence)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not bare:
            raise RequestError(f"bad_words: {word!r} has no tokens", "bad_words")
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    for ids in out:
        check_ids_in_vocab(ids, vocab_size, "bad_words")
    return tuple(tuple(ids) for ids in out)
