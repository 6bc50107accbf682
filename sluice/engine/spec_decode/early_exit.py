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

from sluice.engine.distributed.messages import StepInput
from sluice.engine.request import Request
from sluice.engine.spec_decode.draft_loop import draft_tokens
from sluice.engine.spec_decode.proposer import Proposal


class EarlyExitProposer:
    """Drafts through the target's ModelRunner: under tensor parallelism each draft step goes
    to every rank like a step of the target, with its layer count."""

    writes_kv = True

    def __init__(self, runner, num_layers: int):
        total = runner.model.config.num_hidden_layers
        if not 1 <= num_layers < total:
            raise ValueError(f"early_exit num_layers must be in [1, {total - 1}] for this model")
        self.runner, self.num_layers = runner, num_layers

    def propose(self, reqs: list[Request], num_drafts: list[int],
                block_tables: list[list[int]]) -> Proposal:
        starts = [r.num_computed_tokens for r in reqs]
        return draft_tokens(self._forward, reqs, starts, num_drafts, block_tables,
                            self.runner.block_size)

    def _forward(self, step: StepInput) -> torch.Tensor:
        step.num_layers = self.num_layers
        if self.runner.workers is not None:
            self.runner.workers.broadcast(step)
        return self.runner.run(step)[0]
