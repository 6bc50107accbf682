"""Sluice's round-robin-picker."""

from __future__ import annotations

import itertools

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@plugin("round-robin-picker", NoParams)
class RoundRobinPicker:
    """The candidates in turn: the i-th request starts at candidate i mod n, the others
    follow in candidate order. Scores are ignored."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name
        self._turn = itertools.count()

    def pick(self, req: RoutingRequest, cands: list[Candidate],
             scores: list[float]) -> list[int]:
        n = len(cands)
        i = next(self._turn) % n
        return [*range(i, n), *range(i)]
