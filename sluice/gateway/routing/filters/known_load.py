"""Soft filter: pods whose load is unknown."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@plugin("known-load-filter", NoParams)
class KnownLoadFilter:
    """Soft: a pod whose load entry expired (its /metrics went silent) is not
    preferred over pods whose load is known, whatever prefix it holds."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def filter(self, req: RoutingRequest, cands: list[Candidate]) -> list[Candidate]:
        kept = [c for c in cands if c.load_known]
        return kept or cands
