"""Draft-model proposer: a smaller model with the target's vocabulary, in the same process.

Its paged K/V cache has as many blocks as the target's and follows the target's block
tables (block b of the draft cache holds the draft's K/V for the tokens the target keeps
in its block b), so the draft needs no allocator of its own. The draft keeps, per
request, how many leading positions of its cache are valid: everything up to the last
proposal's known tokens, plus the drafts the target then accepted (their K/V was
written while drafting). A preemption (new block table) starts it over at 0. A prefix
shared with another request is recomputed into the shared blocks: same tokens, same
K/V, so the other request's draft reads the same values.

Vocabulary: the draft's vocab_size must equal the target's (checked at start-up);
drafts are token ids, so a different tokenizer would make every draft wrong.
"""

from __future__ import annotations

import weakref

import torch

from sluice.engine.attention.backend import kv_cache_shape
from sluice.engine.distributed.messages import StepInput
from sluice.engine.loader import load_model
from sluice.engine.model_runner import build_metadata
from sluice.engine.models.causal_lm import CausalLM
from sluice.engine.request import Request
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.draft_loop import draft_tokens
from sluice.engine.spec_decode.proposer import Proposal
from sluice.engine.tensors import to_device


class DraftModelProposer:
    writes_kv = True

    def __init__(self, config: SpeculativeConfig, target: CausalLM, num_blocks: int,
                 block_size: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                 device: torch.device, seed: int):
        """The draft's KV cache: the target's block count and cache dtype."""
        backend = target.attn_backend
        self.model = load_model(config.model, config.load_format, backend, dtype, device, seed)
        dcfg, tcfg = self.model.config, target.config
        if dcfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"draft model {config.model!r} has a vocabulary of {dcfg.vocab_size} "
                             f"tokens, the target {tcfg.vocab_size}: they must share one")
        shape = kv_cache_shape(num_blocks, block_size, dcfg.num_key_value_heads, dcfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=cache_dtype, device=device)
                          for _ in range(dcfg.num_hidden_layers)]
        self.block_size, self.device = block_size, device
        # request -> (num_preemptions, valid positions, drafts last proposed)
        self._state: weakref.WeakKeyDictionary[Request, tuple[int, int, list[int]]] = (
            weakref.WeakKeyDictionary())

    def propose(self, reqs: list[Request], num_drafts: list[int],
                block_tables: list[list[int]]) -> Proposal:
        starts = [self._num_valid(r) for r in reqs]
        proposal = draft_tokens(self._forward, reqs, starts, num_drafts, block_tables,
                                self.block_size)
        for r, d in zip(reqs, proposal.token_ids):
            self._state[r] = (r.num_preemptions, r.num_tokens, d)
        return proposal

    def _num_valid(self, req: Request) -> int:
        """Leading positions whose draft K/V is current (at most num_tokens - 1: the last
        token always runs, its logits give draft 1)."""
        state = self._state.get(req)
        if state is None or state[0] != req.num_preemptions:
            return 0
        _, valid, drafts = state
        matched = 0  # drafts[j] was the input at position valid + j (j < k - 1)
        while (matched < len(drafts) - 1 and valid + matched < req.num_tokens
               and req.token_ids[valid + matched] == drafts[matched]):
            matched += 1
        return min(valid + matched, req.num_tokens - 1)

    def _forward(self, step: StepInput) -> torch.Tensor:
        dev = self.device
        meta = build_metadata(step.slots, step.query_start_loc, step.seq_lens,
                              step.block_tables, dev)
        hidden = self.model(to_device(step.input_ids, torch.long, dev),
                            to_device(step.positions, torch.long, dev), self.kv_caches, meta)
        return self.model.compute_logits(hidden[step.logit_rows[0]])
