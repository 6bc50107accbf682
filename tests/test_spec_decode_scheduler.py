"""Scheduler and KV invariants with drafts, under random workloads (no model).

A fake proposer drafts random tokens (writing K/V, so the lookahead slots are taken
before the step); the "target" accepts a random prefix and appends one more token.
Checked every step: the budget counts drafts; a decode with drafts runs 1 + k tokens
on slots its block table covers; only blocks entirely below num_computed_tokens are
hashed (never one holding a rejected draft's K/V); blocks all return to the pool.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.engine.config import SchedulerConfig
from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.proposer import Proposal
from sluice.engine.spec_decode.speculator import Speculator


class RandomProposer:
    writes_kv = True

    def __init__(self, rng: random.Random, block_size: int):
        self.rng, self.block_size = rng, block_size

    def propose(self, reqs, num_drafts, block_tables):
        for r, k, t in zip(reqs, num_drafts, block_tables):
            assert r.num_computed_tokens + 1 == r.num_tokens, "decodes only"
            assert len(t) * self.block_size >= r.num_computed_tokens + k, "lookahead slots"
        return Proposal([[self.rng.randrange(100) for _ in range(self.rng.randint(0, k))]
                         for k in num_drafts])


workload = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "num_blocks": st.integers(12, 64),
    "budget": st.integers(1, 64),
    "k": st.integers(1, 5),
    "max_num_seqs": st.integers(1, 8),
    "num_requests": st.integers(1, 10),
    "prefix_caching": st.booleans(),
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_drafts_keep_the_invariants(w):
    rng = random.Random(w["seed"])
    bs = w["block_size"]
    kv = KVCacheManager(w["num_blocks"], bs, w["prefix_caching"])
    max_model_len = w["num_blocks"] * bs
    sched = Scheduler(SchedulerConfig(max_num_seqs=w["max_num_seqs"],
                                      max_num_batched_tokens=w["budget"]), kv, max_model_len)
    spec = Speculator(SpeculativeConfig("ngram", w["k"]), RandomProposer(rng, bs), kv, max_model_len)
    prefix = [rng.randrange(100) for _ in range(20)]
    for i in range(w["num_requests"]):
        prompt = (prefix[:rng.randint(0, 20)] + [rng.randrange(100) for _ in range(rng.randint(1, 12))])
        sched.add(Request(f"r{i}", prompt[: max_model_len - 1], SamplingParams(
            max_tokens=rng.randint(1, 24))))
    num_verified = 0
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.num_tokens <= w["budget"], "the budget counts draft tokens"
        for req, n in out.scheduled:
            d = len(req.spec_token_ids)
            assert len(kv.block_table(req.request_id)) * bs >= req.num_computed_tokens + n
            if d:
                assert n == 1 + d and req.num_computed_tokens + 1 == req.num_tokens
            else:
                assert req.num_computed_tokens + n <= req.num_tokens
        kv.check_invariants()
        for req in sched.update_after_step(out):
            drafts, req.spec_token_ids = req.spec_token_ids, []
            accepted = drafts[:rng.randint(0, len(drafts))]
            num_verified += bool(drafts)
            emitted = accepted + [rng.randrange(100)]
            for tok in emitted:
                req.token_ids.append(tok)
                if (req.num_output_tokens >= req.params.max_tokens
                        or req.num_tokens >= max_model_len):
                    req.finish("length")
                    break
            if req.is_finished:
                sched.finish(req)
                continue
            req.num_computed_tokens += len(accepted)
            assert req.num_computed_tokens == req.num_tokens - 1
        for req in sched.running:  # hashed blocks hold committed tokens only
            for i, b in enumerate(kv.block_table(req.request_id)):
                if kv.block_hash[b] is not None:
                    assert (i + 1) * bs <= req.num_computed_tokens
                    assert kv.block_hash[b] == req.block_hashes[i]
        spec.propose(sched.running)
        kv.check_invariants()
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    kv.check_invariants()
