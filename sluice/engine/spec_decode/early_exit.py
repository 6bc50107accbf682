"""Early exit (self-speculative, as LayerSkip): the target's first L layers, its final norm
and its LM head draft k tokens; no second model.

K/V: the first L layers of the target compute exactly what the target's own first L
layers compute, so drafting reads the target's committed K/V of those layers and
needs no catch-up: it starts at the request's last token (num_computed_tokens) and
writes layers < L at positions num_tokens - 1 .. num_tokens + k - 2, positions the
verification step rewrites in every layer. Verification reruns the whole model over
the k + 1 positions (simpler than resuming at layer L from the drafts' hidden states,
which would also need the hidden state of the last token under the target's layers).
"""

from __future__ import annotations

import torch

from sluice.engine.models.causal_lm import CausalLM
from sluice.engine.request import Request
from sluice.engine.spec_decode.draft_loop import draft_tokens
from sluice.engine.spec_decode.proposer import Proposal


class EarlyExitProposer:
    writes_kv = True

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], num_layers: int,
                 block_size: int, device: torch.device):
        total = model.config.num_hidden_layers
        if not 1 <= num_layers < total:
            raise ValueError(f"early_exit num_layers must be in [1, {total - 1}] for this model")
        self.model, self.kv_caches, self.num_layers = model, kv_caches[:num_layers], num_layers
        self.block_size, self.device = block_size, device

    def propose(self, reqs: list[Request], num_drafts: list[int],
                block_tables: list[list[int]]) -> Proposal:
        starts = [r.num_computed_tokens for r in reqs]
        return draft_tokens(self._forward, reqs, starts, num_drafts, block_tables,
                            self.block_size, self.device)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        body = self.model.model
        x = body.embed_tokens(input_ids)
        cos_sin = body.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(body.layers[:self.num_layers], self.kv_caches):
            x = layer(cos_sin, x, kv_cache, meta)
        last = [q - 1 for q in meta.query_start_loc_cpu[1:]]
        return self.model.compute_logits(body.norm(x[last]))
