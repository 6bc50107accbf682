"""Soft filter: hot pods of an imbalanced pool."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class ImbalanceParams:
    absolute: float = 16.0  # max - min queue above this ...
    relative: float = 1.5   # ... and max > relative x min: the pool is imbalanced

    def __post_init__(self) -> None:
        assert self.absolute >= 0 and self.relative >= 1.0


@plugin("load-imbalance-filter", ImbalanceParams)
class ImbalanceFilter:
    """Soft: when load is imbalanced (max - min queue > absolute and max > relative x
    min, SGLang's rule), pods above both thresholds are hot and dropped, so no prefix
    hit can pile more work on them."""

    def __init__(self, name: str, params: ImbalanceParams, ctx: PluginContext) -> None:
        self.name, self.abs, self.rel = name, params.absolute, params.relative

    def filter(self, req: RoutingRequest, cands: list[Candidate]) -> list[Candidate]:
        if len(cands) < 2:
            return cands
        queues = [c.queue for c in cands]
        lo, hi = min(queues), max(queues)
        if not (hi - lo > self.abs and hi > self.rel * lo):
            return cands
        kept = [c for c in cands if not (c.queue - lo > self.abs and c.queue > self.rel * lo)]
        return kept or cands
