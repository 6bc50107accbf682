"""llm-d's P/D deciders: whether a request's prompt is prefilled on a prefill pod,
given the decode profile's target (its predicted prefix hits)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@dataclass(frozen=True)
class PrefixDeciderParams:
    non_cached_tokens: int = 0  # uncached prompt tokens that make it worth it (0: never)
    prompt_tokens: int = 0      # and at least this long a prompt (0: any)

    def __post_init__(self) -> None:
        assert self.non_cached_tokens >= 0 and self.prompt_tokens >= 0


@plugin("prefix-based-pd-decider", PrefixDeciderParams)
class PrefixBasedPDDecider:
    """Disaggregate when nonCachedTokens >= 1, the prompt has at least nonCachedTokens
    (and promptTokens) tokens, and the tokens the decode target would compute itself
    (the prompt's minus its predicted prefix hits) are at least nonCachedTokens. A
    short or mostly-cached prompt is prefilled by the decode pod: a transfer would cost
    more than the prefill it saves, and the decode pod's cache already holds the rest.
    The hits are the plan's prefix producer's; a plan without one predicts none."""

    def __init__(self, name: str, params: PrefixDeciderParams, ctx: PluginContext) -> None:
        self.name, self.params = name, params

    def disaggregate(self, req: RoutingRequest, target: Candidate) -> bool:
        p, n = self.params, len(req.token_ids)
        return (p.non_cached_tokens >= 1 and n >= max(p.non_cached_tokens, p.prompt_tokens)
                and target.uncached_tokens >= p.non_cached_tokens)


@plugin("always-disagg-pd-decider", NoParams)
class AlwaysDisaggPDDecider:
    """Every request is prefilled on a prefill pod (when the pool has a healthy one)."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def disaggregate(self, req: RoutingRequest, target: Candidate) -> bool:
        return True


class ThresholdDecider:
    """llm-d's pd-profile-handler before deciders (its `threshold` parameter): 0 always
    disaggregates; otherwise when the decode target's uncached tokens reach it."""

    name = "threshold"

    def __init__(self, threshold: int) -> None:
        assert threshold >= 0
        self.threshold = threshold

    def disaggregate(self, req: RoutingRequest, target: Candidate) -> bool:
        return self.threshold == 0 or target.uncached_tokens >= self.threshold
