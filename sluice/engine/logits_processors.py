"""Per-request constraints on the next token: allowed_token_ids, bad_words, min_tokens,
logit_bias (vLLM's built-in logits processors, in vLLM's order).

The sampler calls `apply_logits_processors` after taking the raw logprobs and before
the penalties, and only when some request of the batch uses one of them
(`SamplingParams.constrains_logits`, decided on the host), so other batches pay
nothing. Each kind is one batched tensor op over all the rows that use it; the host
work per step is proportional to those requests' own lists, never to the vocabulary:
- allowed_token_ids: every other logit of the row is -inf;
- bad_words: a one-token word is always banned; a longer word's last token is banned
  where the output so far ends with the word's other tokens (vLLM's rule);
- min_tokens: while fewer than min_tokens tokens were generated, the request's stop
  token ids and EOS (unless ignore_eos) are banned. Not for a request under a grammar:
  the grammar decides where its output ends (both together could forbid every token);
- logit_bias: the bias is added to the logit (-100 bans in practice, +100 forces).
"""

from __future__ import annotations

import torch

from sluice.engine.request import Request
from sluice.engine.tensors import to_device

NEG_INF = float("-inf")


def apply_logits_processors(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Apply the constraints of `reqs` (row i: reqs[i]) to `logits` in place; returns it."""
    rows = [i for i, r in enumerate(reqs) if r.params.constrains_logits]
    if not rows:
        return logits
    vocab, device = logits.shape[1], logits.device
    allowed = [i for i in rows if reqs[i].params.allowed_token_ids is not None]
    if allowed:
        _keep_only_allowed(logits, reqs, allowed)
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i in rows:
        banned = _banned_tokens(reqs[i])
        ban_rows += [i] * len(banned)
        ban_ids += banned
    if ban_ids:
        keep = [j for j, t in enumerate(ban_ids) if t < vocab]  # ids past the logits: moot
        logits.index_put_((to_device([ban_rows[j] for j in keep], torch.long, device),
                           to_device([ban_ids[j] for j in keep], torch.long, device)),
                          torch.tensor(NEG_INF, device=device))
    biased = [i for i in rows if reqs[i].params.logit_bias]
    if biased:
        tensors = [reqs[i].params.index_tensors for i in biased]
        row_idx = torch.cat([torch.full_like(t["bias_ids"], i) for i, t in zip(biased, tensors)])
        col_idx = torch.cat([t["bias_ids"] for t in tensors])
        bias = torch.cat([t["bias"] for t in tensors])
        inside = col_idx < vocab
        logits.index_put_((row_idx[inside].to(device), col_idx[inside].to(device)),
                          bias[inside].to(device, logits.dtype), accumulate=True)
    return logits


def _keep_only_allowed(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    vocab, device = logits.shape[1], logits.device
    ids = [reqs[i].params.index_tensors["allowed"] for i in rows]
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool)
    row_idx = torch.cat([torch.full_like(t, j) for j, t in enumerate(ids)])
    col_idx = torch.cat(ids)
    inside = col_idx < vocab
    keep[row_idx[inside], col_idx[inside]] = True
    index = to_device(rows, torch.long, device)
    logits[index] = logits[index].masked_fill(~keep.to(device), NEG_INF)


def _banned_tokens(req: Request) -> list[int]:
    """This step's banned ids of one request: bad words and, before min_tokens, stops."""
    p = req.params
    banned = list(p.index_tensors["banned"]) if p.bad_words_token_ids else []
    num_out = req.num_output_tokens
    for word in p.bad_words_token_ids:
        k = len(word) - 1
        if k and num_out >= k and req.token_ids[-k:] == list(word[:-1]):
            banned.append(word[-1])
    if num_out < p.min_tokens and req.grammar is None:
        banned += p.stop_token_ids
        if not p.ignore_eos:
            banned += req.eos_token_ids
    return banned
