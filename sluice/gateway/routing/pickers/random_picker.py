"""GIE's random-picker."""

from __future__ import annotations

import random

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.pickers.max_score import PickerParams
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@plugin("random-picker", PickerParams)
class RandomPicker:
    """Every candidate in a uniformly random order (seeded); scores are ignored."""

    def __init__(self, name: str, params: PickerParams, ctx: PluginContext) -> None:
        self.name = name
        self._rng = random.Random(ctx.seed)

    def pick(self, req: RoutingRequest, cands: list[Candidate],
             scores: list[float]) -> list[int]:
        order = list(range(len(cands)))
        self._rng.shuffle(order)
        return order
