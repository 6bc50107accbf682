"""Role filters (llm-d's): a P/D pool's decode profile considers decode-capable pods
only, its prefill profile prefill pods only. Hard: they may keep none."""

from __future__ import annotations

from sluice.gateway.discovery.static import PREFILL
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


class RoleFilter:
    hard = True
    prefill = False  # the role kept: prefill, or every other (decode, both, none)

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def filter(self, req: RoutingRequest, cands: list[Candidate]) -> list[Candidate]:
        return [c for c in cands if (c.role == PREFILL) == self.prefill]


@plugin("decode-filter", NoParams)
class DecodeFilter(RoleFilter):
    """Keeps pods that decode: role decode, both, or none given (a pool without roles)."""


@plugin("prefill-filter", NoParams)
class PrefillFilter(RoleFilter):
    """Keeps prefill pods only."""

    prefill = True
