"""Build OpenAI response objects (completions and chat, full and streamed) from engine outputs."""

from __future__ import annotations

import json
import time

from sluice.engine.outputs import RequestOutput, TokenLogprob

# A token a grammar forbids has logprob -inf, which JSON cannot carry (Starlette refuses to
# encode it: a 500). vLLM writes such logprobs as -9999.0; so does Sluice.
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


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
        self.prompt_logprobs: list | None = None  # PromptLogprob | None per prompt token
        self.num_outputs = 0
        self.kv_transfer_params: dict | None = None  # a prefill leg's answer

    def add(self, out: RequestOutput) -> None:
        self.num_outputs += 1
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.new_text
        if out.new_logprobs:
            self.logprobs += out.new_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


def usage(choices: list[ChoiceState]) -> dict:
    """Totals over the choices; a prompt shared by n choices counts once per choice (vLLM)."""
    prompt = sum(c.num_prompt_tokens for c in choices)
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in choices)}}


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int = 0,
                        prompt_ids: list[int] | None = None,
                        prompt_entries: list | None = None) -> dict:
    """OpenAI's completions logprobs. With echo, `prompt_ids` and their PromptLogprob
    entries come first; a prompt token without an entry (the first) has null logprob
    and alternatives."""
    entries: list = []
    if prompt_ids is not None:
        for token, e in zip(prompt_ids, prompt_entries or [None] * len(prompt_ids)):
            entries.append((token, None, None) if e is None else (token, _lp(e.logprob), e.top))
    entries += [(lp.token_id, _lp(lp.logprob), lp.top) for lp in lps]
    tokens = [_text(tokenizer, t) for t, _, _ in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [v for _, v, _ in entries],
        "top_logprobs": [None if top is None else {_text(tokenizer, a): _lp(v) for a, v in top}
                         for _, _, top in entries],
        "text_offset": offsets,
    }


def prompt_logprobs(tokenizer, entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt token and its top alternatives."""
    if entries is None:
        return None
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        item = {str(t): {"logprob": _lp(v), "rank": r + 1, "decoded_token": _text(tokenizer, t)}
                for r, (t, v) in enumerate(e.top)}
        item[str(e.token_id)] = {"logprob": _lp(e.logprob), "rank": e.rank,
                                 "decoded_token": _text(tokenizer, e.token_id)}
        out.append(item)
    return out


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

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
