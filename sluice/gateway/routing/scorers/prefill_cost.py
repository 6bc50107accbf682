"""Sluice's prefill-cost-scorer."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@plugin("prefill-cost-scorer", NoParams)
class PrefillCostScorer:
    """score = 1 - prefill_cost / (max prefill_cost over the candidates + 1), where
    prefill_cost = the uncached prompt tokens this picker sent the pod that have not
    produced a first token yet + this prompt's tokens the pod lacks (Dynamo's
    "prefill left after the overlap credit"). In tokens, so pods with other block
    sizes compare alike. Reads the hits a prefix scorer of the profile predicted."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        top = max((c.prefill_cost for c in cands), default=0)
        return [1.0 - c.prefill_cost / (top + 1.0) for c in cands]
