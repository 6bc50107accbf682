"""GIE's weighted-random-picker."""

from __future__ import annotations

import random

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.pickers.max_score import PickerParams
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@plugin("weighted-random-picker", PickerParams)
class WeightedRandomPicker:
    """The candidates drawn one after another without replacement, each with
    probability proportional to its score (A-Res, Efraimidis-Spirakis: key =
    u^(1/score), highest first), uniformly when every score is 0; a pod scoring 0
    comes last."""

    def __init__(self, name: str, params: PickerParams, ctx: PluginContext) -> None:
        self.name = name
        self._rng = random.Random(ctx.seed)

    def pick(self, req: RoutingRequest, cands: list[Candidate],
             scores: list[float]) -> list[int]:
        if not any(s > 0 for s in scores):
            order = list(range(len(cands)))
            self._rng.shuffle(order)
            return order
        keys = [self._rng.random() ** (1.0 / s) if s > 0 else -1.0 for s in scores]
        return sorted(range(len(cands)), key=lambda i: -keys[i])
