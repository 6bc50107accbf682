"""Drafting with a paged model: catch up on the request's tokens, then k - 1 single-token
steps, all batched.

Step 0 runs each request's tokens from `starts[i]` (the first position whose K/V the
drafting model lacks) to its last token and drafts from the logits at the last.
Step j feeds draft j at position num_tokens - 1 + j. K/V goes to the slots of the
request's block table (the same table as the target's, extended by the caller to
num_computed_tokens + k tokens), so positions written are < num_tokens - 1 + k.
Each draft comes from the logits after the request's own logits processors and
penalties (`sampler.process_logits` on a view holding the drafts so far), so a request
with a logit_bias or a presence penalty gets drafts its target would pick. Greedy and
seeded requests take the argmax (a point mass: a seeded request then emits exactly
what it emits without drafts); other sampled requests sample from the drafting
model's own sampling distribution q (temperature, top-k/p, min-p), returned with the
drafts for the rejection sampler: accepted with probability min(1, p/q), more often
than a point mass is when p and q are spread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.engine.distributed.messages import StepInput
from sluice.engine.request import Request
from sluice.engine.sampler import process_logits, sampling_probs
from sluice.engine.spec_decode.proposer import Proposal
from sluice.engine.spec_decode.verify import request_view

# a step's inputs -> the logits of its rows `logit_rows[0]` (each sequence's last)
Forward = Callable[[StepInput], torch.Tensor]


def draft_tokens(forward: Forward, reqs: list[Request], starts: list[int], num_drafts: list[int],
                 tables: list[list[int]], block_size: int) -> Proposal:
    """`forward` returns the logits of the last row of each sequence of the step."""
    drafts: list[list[int]] = [[] for _ in reqs]
    sampled = [not r.params.greedy and r.generator is None for r in reqs]
    q_rows: list[list[torch.Tensor]] = [[] for _ in reqs]
    live = [i for i, k in enumerate(num_drafts) if k > 0]
    for j in range(max(num_drafts, default=0)):
        live = [i for i in live if num_drafts[i] > j]
        if not live:
            break
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for i in live:
            req, table = reqs[i], tables[i]
            n = req.num_tokens
            if j == 0:
                assert 0 <= starts[i] < n
                span = range(starts[i], n)
                ids += req.token_ids[starts[i]:n]
            else:
                span = range(n - 1 + j, n + j)
                ids.append(drafts[i][-1])
            assert len(table) * block_size > span[-1], "block table must cover the drafts"
            pos += span
            slots += [table[p // block_size] * block_size + p % block_size for p in span]
            qsl.append(qsl[-1] + len(span))
            seq_lens.append(span[-1] + 1)
        logits = forward(StepInput(ids, pos, slots, qsl, seq_lens, [tables[i] for i in live],
                                   [[q - 1 for q in qsl[1:]]]))
        views = [request_view(reqs[i], drafts[i]) for i in live]
        logits, _ = process_logits(logits, views, with_logprobs=False)
        tokens = logits.argmax(dim=-1)
        rows = [r for r, i in enumerate(live) if sampled[i]]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            q = sampling_probs(logits[index], [views[r] for r in rows])
            tokens[index] = torch.multinomial(q, 1).squeeze(1)
            for r, row_q in zip(rows, q):
                q_rows[live[r]].append(row_q)
        for i, t in zip(live, tokens.tolist()):
            drafts[i].append(t)
    probs = [torch.stack(q) if q else None for q in q_rows] if any(sampled) else []
    return Proposal(drafts, probs)
