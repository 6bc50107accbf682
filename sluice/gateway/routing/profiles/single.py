"""GIE's single-profile-handler."""

from __future__ import annotations

from collections.abc import Mapping

from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest, SchedulingResult
from sluice.gateway.routing.registry import NoParams, PluginError, plugin


@plugin("single-profile-handler", NoParams)
class SingleProfileHandler:
    """Runs the configuration's one profile once; its target is the destination."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name
        self.profile: str | None = None  # set by the configuration (`bind`)

    def bind(self, profiles: list[str]) -> None:
        if len(profiles) != 1:
            raise PluginError(f"the single-profile-handler runs exactly one profile, "
                             f"not {len(profiles)} ({', '.join(profiles)})")
        self.profile = profiles[0]

    def pick_profiles(self, req: RoutingRequest, profiles: Mapping[str, object],
                      results: Mapping[str, ProfileResult | None]) -> list[str]:
        assert self.profile is not None
        return [] if results else [self.profile]

    def process_results(self, req: RoutingRequest,
                        results: Mapping[str, ProfileResult | None]) -> SchedulingResult:
        assert self.profile is not None
        return SchedulingResult(results, self.profile)
