"""GIE's approx-prefix-cache-producer: predicted prefix hits from this picker's own
routing history."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sluice.gateway.index.local_index import LocalIndex, LocalIndexConfig
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest
from sluice.gateway.routing.registry import plugin
from sluice.gateway.routing.scorers.prefix_hits import key_groups, set_hits

HISTORY_PODS = 8  # the history is one LRU for all pods, sized for this many


@dataclass(frozen=True)
class ApproxPrefixParams:
    max_prefix_blocks_to_match: int = 2048  # leading blocks looked up (0: no limit)
    max_prefix_tokens_to_match: int = 0     # > 0: at most this many tokens' blocks
    lru_capacity_per_server: int = 31250    # blocks remembered per pod (GIE's default)
    history_ttl_ms: int = 600_000           # how long a routing decision counts (Sluice's)
    # GIE hashes the prompt in blocks of `blockSizeTokens` (or `blockSize` characters),
    # or the pod's own block size with `autoTune`; Sluice always keys the prompt's token
    # ids in each pod's own KV block size (the keys the event-fed index uses too)
    IGNORED = ("autoTune", "blockSizeTokens", "blockSize", "hashBlockSize")

    def __post_init__(self) -> None:
        assert self.max_prefix_blocks_to_match >= 0 and self.max_prefix_tokens_to_match >= 0
        assert self.lru_capacity_per_server > 0 and self.history_ttl_ms > 0


@plugin("approx-prefix-cache-producer", ApproxPrefixParams)
class ApproxPrefixCacheProducer:
    """Predicted hits = the leading prompt blocks this picker recently sent to the pod
    (consecutive from the first), from a bounded history of its own decisions
    (`lruCapacityPerServer` x 8 blocks in all, least recently used dropped first; each
    decision counts for `historyTtlMs`). Every profile's target is recorded (the
    destination and, disaggregated, the prefill pod). No KV events needed; blind to
    evictions and to other replicas' decisions."""

    uses_prompt = True
    produces_prefix = True

    def __init__(self, name: str, params: ApproxPrefixParams, ctx: PluginContext) -> None:
        self.name, self.params = name, params
        self.history = LocalIndex(LocalIndexConfig(
            max_speculative_keys=params.lru_capacity_per_server * HISTORY_PODS))

    def _limit(self, block_size: int) -> int | None:
        p = self.params
        limits = [n for n in (p.max_prefix_blocks_to_match,
                              p.max_prefix_tokens_to_match // block_size) if n > 0]
        return min(limits) if limits else None

    async def prepare(self, req: RoutingRequest, cands: list[Candidate]) -> None:
        now = time.time() * 1000.0
        for keys, members in key_groups(req, cands):
            keys = keys[:self._limit(members[0].block_size)]
            set_hits(members, self.history.lookup(keys, [c.pod for c in members], now))

    def pre_request(self, req: RoutingRequest, profile: str,
                    result: ProfileResult) -> tuple[str, ...]:
        t = result.target
        if req.token_ids:
            keys = req.keys_by[t.key_group][:self._limit(t.block_size)]
            self.history.add_speculative(t.pod, keys,
                                         time.time() * 1000.0 + self.params.history_ttl_ms)
        return ()
