"""The engine's side of speculative decoding: who gets drafts, how many, and the counts.

After each step the engine calls `propose(running)`. A request gets up to k drafts when
it is in decode and speculation is on for the step (fewer running requests than
disable_by_batch_size): k = num_speculative_tokens, capped so that the k + 1 tokens a
verification can emit stay within max_tokens and max_model_len. A proposer that writes
K/V first gets the request's block table extended to num_computed_tokens + k tokens
(`allocate_slots` lookahead: slots, never hashed); a request whose blocks cannot be
had drafts nothing. A request under a grammar keeps only the drafts its grammar
accepts (`validate_tokens`). The drafts wait in `req.spec_token_ids` for the
scheduler, which may trim them to its budget.
"""

from __future__ import annotations

from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.request import Request
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.proposer import Proposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, kv: KVCacheManager,
                 max_model_len: int):
        self.config, self.proposer, self.kv = config, proposer, kv
        self.max_model_len = max_model_len

    def enabled_for(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return not limit or num_running < limit

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` of the running requests for the next step."""
        if not self.enabled_for(len(running)):
            for r in running:
                r.spec_token_ids = []
            return
        reqs, ks = [], []
        for r in running:
            r.spec_token_ids = []
            k = self._num_drafts(r)
            if k <= 0:
                continue
            if self.proposer.writes_kv and not self.kv.allocate_slots(r, 0,
                                                                      num_lookahead_tokens=k):
                continue
            reqs.append(r)
            ks.append(k)
        if not reqs:
            return
        tables = [self.kv.block_table(r.request_id) for r in reqs]
        proposal = self.proposer.propose(reqs, ks, tables)
        probs = proposal.probs or [None] * len(reqs)
        for r, k, drafts, q in zip(reqs, ks, proposal.token_ids, probs):
            assert len(drafts) <= k, "a proposer drafts at most what it is asked"
            assert q is None or q.shape[0] == len(drafts), "one q row per draft"
            if r.grammar is not None:
                drafts = r.grammar.validate_tokens(drafts)
            r.spec_token_ids = list(drafts)
            r.spec_draft_probs = q

    def _num_drafts(self, req: Request) -> int:
        if req.num_computed_tokens + 1 != req.num_tokens or req.is_finished:
            return 0  # not in decode
        room = min(req.params.max_tokens - req.num_output_tokens,
                   self.max_model_len - req.num_tokens) - 1
        return min(self.config.num_speculative_tokens, room)
