"""llm-d's no-hit-lru-scorer."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class NoHitLruParams:
    lru_size: int = 1024  # pods remembered
    # the prefix producer it reads (the plan has one)
    IGNORED = ("prefixPluginType", "prefixPluginName", "prefixMatchInfoProducerName")

    def __post_init__(self) -> None:
        assert self.lru_size > 0


@plugin("no-hit-lru-scorer", NoHitLruParams)
class NoHitLruScorer:
    """Spreads cold requests (no candidate holds any of the prompt's blocks): pods that
    never took a cold request first, then the least recently used; score of the i-th of
    N in that order = 1 - i / (N - 1) (1 when N = 1). A warm request scores 0.5
    everywhere (the prefix scorer decides). Each cold request's targets become the most
    recently used."""

    consumes_prefix = True

    def __init__(self, name: str, params: NoHitLruParams, ctx: PluginContext) -> None:
        self.name, self.size = name, params.lru_size
        self._used: OrderedDict[str, None] = OrderedDict()  # least recently used first

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        if any(c.hit_blocks for c in cands):
            return [0.5] * len(cands)
        n = len(cands)
        if n == 1:
            return [1.0]
        fresh = [c.pod for c in cands if c.pod not in self._used]
        present = {c.pod for c in cands}
        order = fresh + [p for p in self._used if p in present]
        rank = {p: i for i, p in enumerate(order)}
        return [max(1.0 - rank[c.pod] / (n - 1), 0.0) for c in cands]

    def pre_request(self, req: RoutingRequest, profile: str,
                    result: ProfileResult) -> tuple[str, ...]:
        if result.cold:
            pod = result.target.pod
            self._used.pop(pod, None)
            self._used[pod] = None
            while len(self._used) > self.size:
                self._used.popitem(last=False)
        return ()
