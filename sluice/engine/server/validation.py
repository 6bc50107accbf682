"""Checks on a parsed request before any of it reaches the engine.

Contract: every function here either returns prompt token ids the engine
accepts (non-empty, each id in [0, vocab), shorter than the context, with room
for the requested completion) or raises RequestError (400, or 429 for a full
waiting queue) naming the param at fault. Tokenizer and chat-template failures
on client text are the client's fault (400), never a 500. A prompt's text is
capped in characters before the tokenizer sees it, and a large one is
tokenized on a worker thread so it cannot stall the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.engine.server.errors import RequestError

# Above this many characters the tokenizer (and chat template) run off the event loop.
OFF_LOOP_CHARS = 4096
# No tokenizer turns more characters than this into one token (the longest tokens of
# common vocabularies are runs of spaces or dashes of a few dozen), so text longer
# than max_model_len * MAX_CHARS_PER_TOKEN cannot fit the context: refused unread.
MAX_CHARS_PER_TOKEN = 64
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * MAX_CHARS_PER_TOKEN


async def completion_prompts(prompt: str | list, tokenizer, limits: Limits,
                             add_special_tokens: bool = True) -> list[list[int]]:
    """The four OpenAI prompt forms (text, texts, ids, lists of ids) as checked id lists."""
    items: list = [prompt] if isinstance(prompt, str) else list(prompt)
    if not items:
        raise RequestError("prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in items):
        items = [items]  # one prompt given as token ids
    if len(items) > limits.max_prompts_per_request:
        raise RequestError(f"a request may batch at most {limits.max_prompts_per_request} "
                           f"prompts (--max-prompts-per-request); this one has {len(items)}",
                           "prompt")
    out = []
    for p in items:
        if isinstance(p, str):
            if tokenizer is None:
                raise RequestError("this model has no tokenizer; send token ids", "prompt")
            check_text_size(len(p), limits, "prompt")
            ids = await tokenize(lambda p=p: tokenizer.encode(p, add_special_tokens), len(p),
                                 "prompt")
        else:
            ids = list(p)
            # Length first: it bounds the vocabulary scan by the context, not the body.
            check_context(len(ids), None, limits.max_model_len, "prompt")
            check_token_ids(ids, limits.vocab_size, "prompt")
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        out.append(ids)
    return out


async def chat_prompt(rendered: Any, encode: Callable[[], list[int]], limits: Limits) -> list[int]:
    """Token ids of a chat prompt: `encode` renders the template and encodes the text;
    `rendered` is what the template renders (messages, tools, ...), sized before any work."""
    size = text_chars(rendered)
    check_text_size(size, limits, "messages")
    ids = await tokenize(encode, size, "messages", "cannot apply the chat template")
    if not ids:
        raise RequestError("the chat template produced an empty prompt", "messages")
    return ids


def check_text_size(num_chars: int, limits: Limits, param: str) -> None:
    if num_chars > limits.max_prompt_chars:
        raise RequestError(
            f"the {param} text is {num_chars} characters; this model's maximum context length "
            f"is {limits.max_model_len} tokens, so at most {limits.max_prompt_chars} characters "
            f"are accepted", param)


async def tokenize(encode: Callable[[], list[int]], num_chars: int, param: str,
                   what: str = "cannot tokenize the prompt") -> list[int]:
    """Run `encode` (on a worker thread above OFF_LOOP_CHARS); its failure is a 400."""
    try:
        if num_chars > OFF_LOOP_CHARS:
            return await asyncio.to_thread(encode)
        return encode()
    except Exception as exc:  # whatever the input made the tokenizer or template raise
        raise RequestError(f"{what}: {exc}", param) from exc


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise RequestError(f"token id {t} (at index {i}) is not in the vocabulary "
                               f"[0, {vocab_size})", param)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  prompt_param: str, max_tokens_param: str = "max_tokens") -> None:
    """vLLM's context-length errors, word for word (clients match on them)."""
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len} tokens in the messages, Please reduce the length of the "
            f"messages.", prompt_param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            f"completion.", max_tokens_param)


def check_queue_room(num_requests: int, room: int, capacity: int) -> None:
    """400 when a request's sub-requests (n x prompts) exceed the whole waiting queue
    (`capacity`: no retry can help), 429 when they do not fit its free `room` now."""
    if num_requests > capacity:
        raise RequestError(
            f"this request needs {num_requests} places in the waiting queue (n x prompts); "
            f"the server takes at most {capacity}", "n")
    if num_requests > room:
        raise RequestError(
            f"server is overloaded: this request needs {num_requests} places in the waiting "
            f"queue (n x prompts) and {room} are free", None, status=429, retry_after=1)


def text_chars(value: Any) -> int:
    """Characters in every string (keys included) of a JSON-like value; iterative."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def check_ids_in_vocab(ids: list[int] | tuple[int, ...] | None, vocab_size: int,
                       param: str) -> None:
    """Token ids a request names (logit_bias, allowed_token_ids) must index the logits."""
    bad = next((t for t in ids or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is not in the vocabulary [0, {vocab_size})", param)
