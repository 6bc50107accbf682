"""GIE's max-score-picker."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class PickerParams:
    # how many endpoints GIE's pickers return; Sluice orders every candidate (the rest
    # are Envoy's fallbacks, up to the picker's --max-fallbacks)
    IGNORED = ("maxNumOfEndpoints",)


@dataclass(frozen=True)
class MaxScoreParams(PickerParams):
    # a cold request (no candidate holds any of its blocks): the target is drawn among the
    # pods scoring within this of the best, which spreads new prefixes over equally
    # loaded pods instead of piling them on the first
    cold_spread: float = 0.0

    def __post_init__(self) -> None:
        assert self.cold_spread >= 0


@plugin("max-score-picker", MaxScoreParams)
class MaxScorePicker:
    """The highest score first, ties (and, for a cold request, scores within
    `coldSpread` of the best) broken at random (seeded); then the rest by score."""

    def __init__(self, name: str, params: MaxScoreParams, ctx: PluginContext) -> None:
        self.name, self.cold_spread = name, params.cold_spread
        self._rng = random.Random(ctx.seed)

    def pick(self, req: RoutingRequest, cands: list[Candidate],
             scores: list[float]) -> list[int]:
        order = sorted(range(len(cands)), key=lambda i: -scores[i])
        cold = all(c.hit_blocks == 0 for c in cands)
        tolerance = self.cold_spread if cold else 1e-9
        best = scores[order[0]]
        tied = [i for i in order if scores[i] >= best - tolerance]
        if len(tied) > 1:
            first = self._rng.choice(tied)
            order.remove(first)
            order.insert(0, first)
        return order
