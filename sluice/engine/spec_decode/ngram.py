"""N-gram (prompt lookup) proposer: no model, vectorised over the batch.

For each request, the longest suffix of its tokens (prompt + output) of length
n in [prompt_lookup_min, prompt_lookup_max] that also occurs earlier; the drafts are
the tokens that followed its most recent earlier occurrence. One [batch, window]
tensor holds every request's last `window` tokens, right-aligned (padding -1 never
equals a token); for each n, `unfold` compares every earlier n-gram with the suffix
in one op. Cost at batch 32, window 1024, n in 1..4: ~4 comparisons of 32 x 1k x n.
"""

from __future__ import annotations

import torch

from sluice.engine.request import Request
from sluice.engine.spec_decode.proposer import Proposal

WINDOW = 1024  # tokens searched per request (the most recent ones)


class NgramProposer:
    writes_kv = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, window: int = WINDOW):
        assert 1 <= prompt_lookup_min <= prompt_lookup_max < window
        self.nmin, self.nmax, self.window = prompt_lookup_min, prompt_lookup_max, window

    def propose(self, reqs: list[Request], num_drafts: list[int],
                block_tables: list[list[int]]) -> Proposal:
        if not reqs:
            return Proposal([])
        return Proposal(propose_ngram([r.token_ids for r in reqs], num_drafts, self.nmin,
                                      self.nmax, self.window))


def propose_ngram(seqs: list[list[int]], num_drafts: list[int], nmin: int, nmax: int,
                  window: int = WINDOW) -> list[list[int]]:
    """Per sequence, the tokens after the latest earlier occurrence of its longest
    matching suffix n-gram (nmax down to nmin), at most num_drafts[i]; [] if none."""
    width = min(window, max(len(s) for s in seqs))
    buf = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        tail = s[-width:]
        buf[i, width - len(tail):] = torch.tensor(tail, dtype=torch.long)
    first_real = width - torch.tensor([min(len(s), width) for s in seqs])
    follow = torch.full((len(seqs),), -1, dtype=torch.long)  # index of the first draft
    for n in range(min(nmax, width - 1), nmin - 1, -1):
        # windows starting at 0 .. width-1-n: each is followed by at least one token,
        # and none is the suffix itself (which starts at width - n)
        grams = buf[:, :width - 1].unfold(1, n, 1)
        match = (grams == buf[:, width - n:].unsqueeze(1)).all(dim=-1)
        starts = torch.arange(match.shape[1])
        match &= starts.unsqueeze(0) >= first_real.unsqueeze(1)
        last = match.shape[1] - 1 - match.flip(1).to(torch.int8).argmax(dim=1)
        found = match.any(dim=1) & (follow < 0)
        follow = torch.where(found, last + n, follow)
    out = []
    for i, f in enumerate(follow.tolist()):
        out.append(buf[i, f:f + num_drafts[i]].tolist() if f >= 0 and num_drafts[i] > 0 else [])
    return out
