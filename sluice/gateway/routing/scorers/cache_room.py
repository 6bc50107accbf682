"""Sluice's cache-room-scorer."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@plugin("cache-room-scorer", NoParams)
class CacheRoomScorer:
    """score = 1 - held_blocks / num_blocks: the fraction of the pod's KV cache not
    holding cached blocks, in use or not (the event index's confirmed keys for the pod
    over its `num_gpu_blocks`; 0 while unknown). KV usage counts only the blocks of
    running requests, so without this term new prefixes are placed blind to the ones
    a pod already keeps, and a pod given more than its cache holds evicts them. Needs
    the precise-prefix-cache-scorer in the profile (it reads the held counts)."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        return [c.cache_room or 0.0 for c in cands]
