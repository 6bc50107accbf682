"""Verification: the target's logits at a request's k + 1 positions decide its tokens.

Contract. Request r verifies drafts d_1..d_k: its logits rows are, in order, the
target's distribution after r's known tokens, after d_1, ..., after d_1..d_k. Each row
is processed exactly as the plain sampler would process it had the drafts before it
already been sampled: a per-position view of r (token_ids extended by those drafts)
goes through `sampler.process_logits`, so penalties, min_tokens, bad_words,
logit_bias and logprobs see the same history; a grammar's bitmask row j is filled
after the matcher accepted d_1..d_j (then rolled back).

Acceptance (drafts are point masses: every built-in proposer drafts greedily, as
vLLM V1's proposers do): row j draws its token x_j as the plain sampler would
(argmax for greedy requests; inverse CDF at one uniform for sampled ones). The
request emits x_1.. while x_j equals d_j, then the first x_j that differs (a
correction), or the bonus x_{k+1} after all k are accepted. For a point-mass draft q,
drawing x ~ p and accepting iff x = d is the rejection-sampling rule: accept with
probability p(d) = min(1, p(d) / q(d)), and on rejection x is distributed as
p restricted to tokens != d, renormalised, which is the residual max(0, p - q)
normalised. So every emitted token has the target's distribution, and a seeded
request draws one uniform per emitted token from its own generator, in order: it
emits the same tokens as without speculation.

A request whose drafts were sampled from a distribution q (`req.spec_draft_probs`: a
draft model drafting for an unseeded sampled request) goes through the general rule
instead, position by position (`rejection_sample`): accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)), else emit a token of the normalised residual
max(0, p_j - q_j) and stop; after all k, the bonus x_{k+1} as above.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from sluice.engine.outputs import TokenLogprob
from sluice.engine.request import Request
from sluice.engine.sampler import gather_logprobs, pick_tokens, process_logits, sampling_probs
from sluice.engine.structured_output.bitmask import apply_grammar_bitmask


@dataclass
class VerifyResult:
    token_ids: list[list[int]]  # per request: accepted drafts, then one sampled token
    logprobs: list[list[TokenLogprob | None]]
    num_accepted: list[int]  # per request: how many drafts were accepted


def verify(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> VerifyResult:
    """logits: [sum(len(d) + 1), vocab]; rows of reqs[i] follow those of reqs[i - 1]."""
    assert len(reqs) == len(drafts)
    assert logits.shape[0] == sum(len(d) + 1 for d in drafts)
    views: list[Request] = []
    owners: list[int] = []  # row -> index into reqs
    for i, (req, d) in enumerate(zip(reqs, drafts)):
        for j in range(len(d) + 1):
            views.append(request_view(req, d[:j]))
            owners.append(i)
    _apply_grammars(logits, reqs, drafts)
    logits, raw_logprobs = process_logits(logits, views)
    u, states = _uniforms(views, owners, reqs, logits.device)
    token_list = pick_tokens(logits, views, u).tolist()
    p_rows = _general_rows(logits, views, reqs, drafts)
    chosen = list(token_list)  # per row: the token emitted there (for its logprob)
    result = VerifyResult([], [], [])
    row = 0
    for i, (req, d) in enumerate(zip(reqs, drafts)):
        if i in p_rows:
            m, last = _accept_general(p_rows[i], req.spec_draft_probs, d)
            emitted = d[:m] + [token_list[row + m] if last is None else last]
        else:
            m = 0
            while m < len(d) and token_list[row + m] == d[m]:
                m += 1
            emitted = token_list[row:row + m + 1]
            if states[i]:  # a seeded row consumed one draw per emitted token, as without drafts
                req.generator.set_state(states[i][m])
        chosen[row:row + m + 1] = emitted
        result.token_ids.append(emitted)
        result.num_accepted.append(m)
        row += len(d) + 1
    row_logprobs = gather_logprobs(raw_logprobs, torch.tensor(chosen, device=logits.device),
                                   chosen, views)
    row = 0
    for emitted, d in zip(result.token_ids, drafts):
        result.logprobs.append(row_logprobs[row:row + len(emitted)])
        row += len(d) + 1
    return result


def _general_rows(logits: torch.Tensor, views: list[Request], reqs: list[Request],
                  drafts: list[list[int]]) -> dict[int, torch.Tensor]:
    """Target sampling distributions p at the draft positions of requests whose drafts
    were sampled from a q: request index -> [len(drafts), vocab]."""
    out: dict[int, torch.Tensor] = {}
    row = 0
    for i, (req, d) in enumerate(zip(reqs, drafts)):
        if d and req.spec_draft_probs is not None:
            assert req.generator is None and not req.params.greedy, "q only for unseeded sampling"
            rows = list(range(row, row + len(d)))
            out[i] = sampling_probs(logits[rows], [views[r] for r in rows])
        row += len(d) + 1
    return out


def _accept_general(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> tuple[int, int | None]:
    """(drafts accepted, the residual's token at the first rejection or None)."""
    for j, d in enumerate(drafts):
        ok, token = rejection_sample(p[j], q[j].to(p.device, p.dtype), d)
        if not ok:
            return j, token
    return len(drafts), None


def request_view(req: Request, drafts: list[int]) -> Request:
    """req as it would be with `drafts` already sampled (no grammar, no generator: the
    verifier applies those itself)."""
    view = copy.copy(req)
    view.token_ids = req.token_ids + drafts if drafts else req.token_ids
    view.grammar = None
    view.generator = None
    return view


def _apply_grammars(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> None:
    """Mask row j of each constrained request with its matcher advanced by d_1..d_j."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not constrained:
        return
    for j in range(max(len(drafts[i]) for i in constrained) + 1):
        live = [i for i in constrained if j <= len(drafts[i])]
        if j:
            for i in live:
                ok = reqs[i].grammar.accept_token(drafts[i][j - 1])
                assert ok, "drafts of a constrained request are validated by the proposer step"
        apply_grammar_bitmask(logits, [reqs[i].grammar for i in live], [starts[i] + j for i in live])
    for i in constrained:
        reqs[i].grammar.rollback(len(drafts[i]))


def _uniforms(views: list[Request], owners: list[int], reqs: list[Request],
              device: torch.device) -> tuple[torch.Tensor | None, list[list]]:
    """One uniform per row; a seeded request's rows draw in order from its generator, and
    states[i][m] is its generator's state after m + 1 draws (restored once m is known)."""
    states: list[list] = [[] for _ in reqs]
    if all(v.params.greedy for v in views):
        return None, states
    u = torch.rand(len(views), 1, device=device)
    for row, i in enumerate(owners):
        g = reqs[i].generator
        if g is not None and not reqs[i].params.greedy:
            u[row] = torch.rand(1, device=device, generator=g)
            states[i].append(g.get_state())
    return u, states


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: int,
                     generator: torch.Generator | None = None) -> tuple[bool, int]:
    """The general rule for one position: p, q are [vocab] target and draft probabilities,
    `draft` was drawn from q. Accept it with probability min(1, p / q); otherwise return a
    token from the normalised residual max(0, p - q). Returns (accepted, token)."""
    assert q[draft] > 0, "the draft token was drawn from q"
    r = torch.rand(1, generator=generator, device=p.device).item()
    if r < min(1.0, (p[draft] / q[draft]).item()):
        return True, draft
    residual = (p - q).clamp_(min=0)
    total = residual.sum()
    if total <= 0:  # p == q: rejection has probability 0; keep the draft's token
        return False, draft
    return False, int(torch.multinomial(residual / total, 1, generator=generator).item())
