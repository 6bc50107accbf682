"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the ones
before it, its rank in the vocabulary, and the top alternatives.

Before each forward pass the model runner asks `plan_prompt_logprobs` which rows of the
step need prompt logprobs, and computes those rows' logits with the sampling rows' (every
tensor-parallel rank takes part in the LM head); `record` then turns each chunk's logits
into entries. For a request that asks (params.prompt_logprobs is not None), the hidden
state at prompt position p gives the distribution of prompt token p + 1. `req.prompt_logprobs` grows in position order: entry 0 is None (the first
token has no context, as in vLLM), entry p + 1 comes from position p. Positions that
were recorded already (a preempted request recomputing its prompt) are skipped, and
positions at or past the last prompt token are not prompt logprobs. A position the
request read from the prefix cache has no hidden state here: its entry is None.

The server therefore gives such requests a cache salt of their own: they never read
the prefix cache (vLLM skips the cache for them too), so every entry is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.outputs import PromptLogprob
from sluice.engine.request import Request

ROWS_PER_CHUNK = 256  # bounds the [rows, vocab] float32 temporaries (49k vocab: 50 MB)


@dataclass(frozen=True)
class PromptChunk:
    """Prompt positions [lo, hi) of `req`, at rows `rows` of the step's hidden states."""

    req: Request
    lo: int
    hi: int
    rows: list[int]


def plan_prompt_logprobs(scheduled: list[tuple[Request, int]],
                         query_start_loc: list[int]) -> list[PromptChunk]:
    """The chunks of positions this step computes that each asking request has not yet
    recorded (its entries for positions read from the prefix cache become None now).

    Rows query_start_loc[i] .. query_start_loc[i + 1] are scheduled[i]'s tokens,
    positions num_computed_tokens .. + num_new (before the step's update)."""
    chunks = []
    for i, (req, num_new) in enumerate(scheduled):
        if req.params.prompt_logprobs is None:
            continue
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        start = req.num_computed_tokens
        while len(req.prompt_logprobs) - 1 < min(start, req.num_prompt_tokens - 1):
            req.prompt_logprobs.append(None)  # read from the prefix cache: never computed
        first = max(start, len(req.prompt_logprobs) - 1)  # next position not yet recorded
        end = min(start + num_new, req.num_prompt_tokens - 1)
        base = query_start_loc[i] - start
        for lo in range(first, end, ROWS_PER_CHUNK):
            hi = min(lo + ROWS_PER_CHUNK, end)
            chunks.append(PromptChunk(req, lo, hi, list(range(base + lo, base + hi))))
    return chunks


def record(chunk: PromptChunk, logits: torch.Tensor) -> None:
    """Append the chunk's entries to its request's `prompt_logprobs`, in position order."""
    req = chunk.req
    assert len(req.prompt_logprobs) - 1 == chunk.lo, "chunks are recorded in order"
    req.prompt_logprobs += _entries(logits, req.prompt_token_ids[chunk.lo + 1: chunk.hi + 1],
                                    req.params.prompt_logprobs)


def _entries(logits: torch.Tensor, next_ids: list[int], k: int) -> list[PromptLogprob]:
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(next_ids, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    top_ids: list = [[]] * len(next_ids)
    top_vals: list = [[]] * len(next_ids)
    if k:
        values, indices = logprobs.topk(k, dim=-1)
        top_ids, top_vals = indices.tolist(), values.tolist()
    return [PromptLogprob(t, lp, r, tuple(zip(ti, tv)))
            for t, lp, r, ti, tv in zip(next_ids, chosen_list, ranks, top_ids, top_vals)]
