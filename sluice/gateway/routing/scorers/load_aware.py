"""llm-d's load-aware-scorer."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class LoadAwareParams:
    threshold: int = 128  # waiting requests at which a pod scores 0 (<= 0: 128)


@plugin("load-aware-scorer", LoadAwareParams)
class LoadAwareScorer:
    """score = 0.5 for an empty waiting queue, else 0.5 x (1 - min(waiting, threshold) /
    threshold): an idle pod is preferred, a queue at the threshold scores 0. Unknown
    load scores 0."""

    def __init__(self, name: str, params: LoadAwareParams, ctx: PluginContext) -> None:
        self.name = name
        self.threshold = params.threshold if params.threshold > 0 else 128

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        t = self.threshold
        return [0.0 if c.waiting is None else 0.5 if c.waiting == 0
                else 0.5 * (1.0 - min(c.waiting, t) / t) for c in cands]
