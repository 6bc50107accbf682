"""llm-d's active-request-scorer."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class ActiveRequestParams:
    idle_threshold: int = 0      # a pod with at most this many requests in flight scores 1
    max_busy_score: float = 1.0  # the most a busy pod scores
    # the in-flight counts are this picker's own (`load.inflight`): always tracked
    IGNORED = ("requestTimeout", "inFlightLoadProducerName")

    def __post_init__(self) -> None:
        assert self.idle_threshold >= 0 and 0.0 <= self.max_busy_score <= 1.0


@plugin("active-request-scorer", ActiveRequestParams)
class ActiveRequestScorer:
    """count = the requests this picker has in flight to the pod. score = 1 when
    count <= idleThreshold, else (max count - count) / max count x maxBusyScore."""

    def __init__(self, name: str, params: ActiveRequestParams, ctx: PluginContext) -> None:
        self.name, self.params = name, params

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        top = max((c.inflight for c in cands), default=0)
        p = self.params
        return [1.0 if c.inflight <= p.idle_threshold or top == 0
                else (top - c.inflight) / top * p.max_busy_score for c in cands]
