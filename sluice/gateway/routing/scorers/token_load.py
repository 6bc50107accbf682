"""llm-d's token-load-scorer."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class TokenLoadParams:
    queue_threshold_tokens: int = 4_194_304  # pending tokens at which a pod scores 0
    IGNORED = ("inFlightLoadProducerName",)


@plugin("token-load-scorer", TokenLoadParams)
class TokenLoadScorer:
    """tokens = the uncached prompt tokens this picker sent the pod that have not
    produced a first token yet; score = 1 - min(tokens, T) / T (T: queueThresholdTokens,
    <= 0: its default)."""

    def __init__(self, name: str, params: TokenLoadParams, ctx: PluginContext) -> None:
        self.name = name
        t = params.queue_threshold_tokens
        self.t = t if t > 0 else TokenLoadParams.queue_threshold_tokens

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        return [1.0 - min(c.pending_prefill, self.t) / self.t for c in cands]
