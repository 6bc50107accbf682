"""GIE's kv-cache-utilization-scorer."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@plugin("kv-cache-utilization-scorer", NoParams)
class KVCacheUtilizationScorer:
    """score = 1 - KV-cache usage (the pod's `vllm:kv_cache_usage_perc`); 0 while its
    load is unknown."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        return [1.0 - min(max(c.kv_usage, 0.0), 1.0) if c.kv_usage is not None else 0.0
                for c in cands]
