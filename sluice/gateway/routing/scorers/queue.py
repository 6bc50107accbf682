"""GIE's queue-scorer."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


def min_max(values: list[float | None]) -> list[float]:
    """(max - v) / (max - min) per value, 1 for all when they are equal (GIE's scorers);
    an unknown value (None) counts as above the largest known one."""
    worst = max((v for v in values if v is not None), default=0.0) + 1.0
    known = [worst if v is None else v for v in values]
    lo, hi = min(known, default=0.0), max(known, default=0.0)
    return [1.0 if hi == lo else (hi - v) / (hi - lo) for v in known]


@plugin("queue-scorer", NoParams)
class QueueScorer:
    """score = (max waiting - waiting) / (max waiting - min waiting) over the candidates
    (the pods' `vllm:num_requests_waiting`); 1 for all when equal. A pod whose load is
    unknown counts as the longest queue."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        return min_max([c.waiting for c in cands])
