"""llm-d's precise-prefix-cache-producer and precise-prefix-cache-scorer: predicted
prefix hits from the engines' KV events."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sluice.gateway.flow.fields import duration_s
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest
from sluice.gateway.routing.registry import plugin
from sluice.gateway.routing.scorers.prefix_hits import hit_fraction, key_groups, set_hits


@dataclass(frozen=True)
class PreciseParams:
    # a decision is written to the index as short-lived (speculative) entries, so a burst
    # of one prefix sticks to one pod before the engine's events arrive
    speculative_indexing: bool = False
    speculative_ttl: str = "2s"
    # llm-d's indexer: Sluice's index is fed by the picker's own subscription to every
    # discovered engine's events, keyed by `prompt.block_keys` in each pod's block size
    IGNORED = ("indexerConfig", "kvEventsConfig", "tokenProcessorConfig")
    NAMES = (("speculative_ttl", "speculativeTTL"),)

    def __post_init__(self) -> None:
        assert duration_s(self.speculative_ttl, "speculativeTTL") >= 0


@plugin("precise-prefix-cache-producer", PreciseParams)
class PrecisePrefixCacheProducer:
    """Predicted hits = the leading prompt blocks the pod holds, as the event-fed index
    knows them (this replica's view, which mirrors the other replicas' decisions, or
    Redis with `--index-reads redis`; then Redis's load entries, read with the lookup,
    replace older local ones), and the blocks its cache holds in all (cache room). A
    block-aligned prompt counts one block less (its last token is always computed).
    With `speculativeIndexing`, each profile's target is recorded for `speculativeTTL`
    as holding the blocks it lacks, renewed while the request runs."""

    uses_prompt = True
    uses_events = True
    produces_prefix = True

    def __init__(self, name: str, params: PreciseParams, ctx: PluginContext) -> None:
        assert ctx.index is not None, f"{self.type} needs the KV-event index"
        self.name, self.index = name, ctx.index
        ttl_ms = round(duration_s(params.speculative_ttl, "speculativeTTL") * 1000)
        self.ttl_ms = ttl_ms if params.speculative_indexing else 0
        self.load_ttl_ms = ctx.load_ttl_ms

    async def prepare(self, req: RoutingRequest, cands: list[Candidate]) -> None:
        now = time.time() * 1000.0
        for keys, members in key_groups(req, cands):
            hits, loads, held = await self.index.lookup(keys, [c.pod for c in members])
            set_hits(members, hits, held)
            for c in members:
                row = loads.get(c.pod) if loads is not None else None
                if row is not None and now - row["ts_ms"] < self.load_ttl_ms:
                    c.waiting, c.running, c.kv_usage, c.load_ts_ms = (
                        row["waiting"], row["running"], row["kv_usage"], row["ts_ms"])

    def pre_request(self, req: RoutingRequest, profile: str,
                    result: ProfileResult) -> tuple[str, ...]:
        t = result.target
        if not self.ttl_ms or not req.token_ids:
            return ()
        spec = req.keys_by[t.key_group][t.hit_blocks:]
        self.index.speculate(t.pod, spec, self.ttl_ms)
        return tuple(spec)

    def renew(self, pod: str, keys: tuple[str, ...]) -> None:
        """The decision's speculative entries last the TTL from now (a running request)."""
        self.index.speculate(pod, list(keys), self.ttl_ms)


@plugin("precise-prefix-cache-scorer", PreciseParams)
class PrecisePrefixCacheScorer(PrecisePrefixCacheProducer):
    """The producer above and a scorer in one (llm-d's older form): score = predicted hit
    blocks / the prompt's full blocks."""

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        return hit_fraction(cands)
