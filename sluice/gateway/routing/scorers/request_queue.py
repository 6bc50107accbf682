"""Sluice's request-queue-scorer."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@plugin("request-queue-scorer", NoParams)
class RequestQueueScorer:
    """score = 1 - queue / (max queue over the candidates + 1), where queue = the
    larger of the pod's scraped waiting + running requests (every picker's) and this
    picker's in-flight requests to it (seen at once, before the next scrape); 0 while
    its load is unknown. Unlike GIE's queue-scorer it counts running requests too,
    and never scores the busiest pod 0 when all are nearly equal."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        top = max((c.queue for c in cands), default=0.0)
        return [1.0 - c.queue / (top + 1.0) if c.load_known else 0.0 for c in cands]
