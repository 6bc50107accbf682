"""Build OpenAI response objects (completions and chat, full and streamed) from engine outputs."""

from __future__ import annotations

import json
import time

from sluice.engine.outputs import RequestOutput, TokenLogprob


class ChoiceState:
    """Accumulates one choice's text, tokens, logprobs and token counts."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        if out.new_logprobs:
            self.logprobs += out.new_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


def usage(choices: list[ChoiceState]) -> dict:
    prompt = sum(c.num_prompt_tokens for c in choices)
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in choices)}}


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int = 0) -> dict:
    tokens = [_text(tokenizer, lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_text(tokenizer, t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]}


def _text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def envelope(rid: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}
