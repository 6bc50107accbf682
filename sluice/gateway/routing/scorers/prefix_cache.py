"""GIE's prefix-cache-scorer."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class PrefixCacheParams:
    match_length_weight: float = 0.0        # w below (llm-d-router's)
    match_length_scale_tokens: int = 8192   # a match this long scores 1 on length
    # the producer's knobs, which GIE <= 1.4 gave the scorer (the producer's defaults
    # apply), and the producer it reads (the plan has one: the precise or approximate)
    IGNORED = ("hashBlockSize", "maxPrefixBlocksToMatch", "lruCapacityPerServer", "autoTune",
               "blockSize", "blockSizeTokens", "prefixMatchInfoProducerName")

    def __post_init__(self) -> None:
        assert 0.0 <= self.match_length_weight <= 1.0 and self.match_length_scale_tokens > 0


@plugin("prefix-cache-scorer", PrefixCacheParams)
class PrefixCacheScorer:
    """ratio = predicted hit blocks / the prompt's full blocks; length = min(1, hit
    tokens / matchLengthScaleTokens)^2; score = w x length + (1 - w) x ratio. The hits
    come from the plan's prefix producer (the precise one from KV events, else the
    approximate one, added when none is configured)."""

    consumes_prefix = True

    def __init__(self, name: str, params: PrefixCacheParams, ctx: PluginContext) -> None:
        self.name, self.w = name, params.match_length_weight
        self.scale = params.match_length_scale_tokens

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        w, out = self.w, []
        for c in cands:
            ratio = c.hit_blocks / c.total_blocks if c.total_blocks else 0.0
            length = min(1.0, c.hit_blocks * c.block_size / self.scale) ** 2 if w else 0.0
            out.append(w * length + (1.0 - w) * ratio)
        return out
