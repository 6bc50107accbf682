"""The proposer plug point: a method that drafts tokens for requests in decode.

Contract (`Proposer.propose`):
- every request given is in decode: num_computed_tokens == num_tokens - 1, its last
  token not yet run through the target;
- it returns a `Proposal`: per request at most num_drafts[i] token ids, and either
  nothing more (the drafts were chosen deterministically: point-mass draft
  distributions) or, per request, the distribution q each draft was sampled from
  ([len(drafts), vocab], q[j, d_j] > 0); `verify.py` needs exactly one of the two to
  stay lossless;
- it changes no request state. A proposer with `writes_kv` runs a model whose K/V
  lives at the request's own positions: the caller first extends the request's
  block table to cover num_computed_tokens + num_drafts[i] tokens, and the proposer
  writes only positions >= num_computed_tokens of the target's cache (never a
  committed, hence possibly shared, block) or any position of its own cache.
New methods add a module here and a branch in `build_proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from sluice.engine.request import Request
from sluice.engine.spec_decode.config import SpeculativeConfig


@dataclass
class Proposal:
    token_ids: list[list[int]]
    probs: list[torch.Tensor | None] = field(default_factory=list)  # [] or one per request


class Proposer(Protocol):
    writes_kv: bool

    def propose(self, reqs: list[Request], num_drafts: list[int],
                block_tables: list[list[int]]) -> Proposal:
        ...


def build_proposer(config: SpeculativeConfig, runner, dtype, device, seed: int) -> Proposer:
    """The configured method's proposer; `runner` is the target's ModelRunner."""
    if config.method == "ngram":
        from sluice.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "early_exit":
        from sluice.engine.spec_decode.early_exit import EarlyExitProposer

        return EarlyExitProposer(runner, config.num_layers)
    from sluice.engine.spec_decode.draft_model import DraftModelProposer

    cache = runner.kv_caches[0]
    return DraftModelProposer(config, runner.model, cache.shape[1], runner.block_size, dtype,
                              cache.dtype, device, seed)
