"""GIE's running-requests-size-scorer."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin
from sluice.gateway.routing.scorers.queue import min_max


@plugin("running-requests-size-scorer", NoParams)
class RunningRequestsScorer:
    """score = (max running - running) / (max running - min running) over the candidates
    (`vllm:num_requests_running`); 1 for all when equal; unknown load counts as the most."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        return min_max([c.running for c in cands])
