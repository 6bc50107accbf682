"""Routing strategies, built once from the config (`make_strategy`).

- `RoundRobin`: the healthy pods in turn; no prompt, no load.
- `LeastLoad`: filters, then the queue and free-KV scores.
- `Prefix` (approximate): + hits from this picker's own routing history.
- `KVAware` (precise): + hits from the event-fed index (this replica's view, which
  mirrors the other replicas' decisions, or Redis with `--index-reads redis`) and
  the shared loads; each decision is written back as speculative entries (TTL
  `speculative_ttl_ms`), so a burst of one prefix sticks to one pod before the
  engine's events arrive.
"""

from __future__ import annotations

import time

from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.config import RoutingConfig
from sluice.gateway.routing.scorers import (
    CacheRoomScorer,
    KVUsageScorer,
    PrefillCostScorer,
    PrefixScorer,
    QueueScorer,
    Scorer,
)

Loads = dict[str, dict[str, float]]


class RoundRobin:
    name = "round_robin"
    ranked = False  # pods in turn: no candidates scored
    uses_prompt = False
    uses_events = False


class LeastLoad:
    name = "least_load"
    ranked = True
    uses_prompt = False
    uses_events = False

    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.parts: list[tuple[float, Scorer]] = [(cfg.w_queue, QueueScorer()),
                                                  (cfg.w_kv, KVUsageScorer())]

    async def hits(self, keys: list[str], pods: list[str]
                   ) -> tuple[dict[str, int], Loads | None, dict[str, int]]:
        """(hit blocks, shared loads or None, held blocks) by pod."""
        return {}, None, {}

    def remember(self, chosen: Candidate, keys: list[str]) -> tuple[str, ...]:
        """Record the decision; the keys written as speculative entries."""
        return ()


def _prompt_parts(cfg: RoutingConfig, load_parts: list[tuple[float, Scorer]]
                  ) -> list[tuple[float, Scorer]]:
    """The prefix-hit and prefill-cost scores, then the load ones."""
    return [(cfg.w_prefix, PrefixScorer()), (cfg.w_prefill, PrefillCostScorer()), *load_parts]


class Prefix(LeastLoad):
    name = "prefix"
    uses_prompt = True

    def __init__(self, cfg: RoutingConfig, history: LocalIndex) -> None:
        super().__init__(cfg)
        self.history = history
        self.parts = _prompt_parts(cfg, self.parts)

    async def hits(self, keys: list[str], pods: list[str]
                   ) -> tuple[dict[str, int], Loads | None, dict[str, int]]:
        return self.history.lookup(keys, pods, time.time() * 1000.0), None, {}

    def remember(self, chosen: Candidate, keys: list[str]) -> tuple[str, ...]:
        self.history.add_speculative(chosen.pod, keys,
                                     time.time() * 1000.0 + self.cfg.history_ttl_ms)
        return ()


class KVAware(LeastLoad):
    name = "kv_aware"
    uses_prompt = True
    uses_events = True

    def __init__(self, cfg: RoutingConfig, index: PrefixIndex) -> None:
        super().__init__(cfg)
        self.index = index
        self.parts = [*_prompt_parts(cfg, self.parts), (cfg.w_room, CacheRoomScorer())]

    async def hits(self, keys: list[str], pods: list[str]
                   ) -> tuple[dict[str, int], Loads | None, dict[str, int]]:
        return await self.index.lookup(keys, pods)

    def remember(self, chosen: Candidate, keys: list[str]) -> tuple[str, ...]:
        if not self.cfg.speculative_ttl_ms:
            return ()
        spec = keys[chosen.hit_blocks:]
        self.index.speculate(chosen.pod, spec, self.cfg.speculative_ttl_ms)
        return tuple(spec)


Strategy = RoundRobin | LeastLoad | Prefix | KVAware


def make_strategy(cfg: RoutingConfig, index: PrefixIndex | None,
                  history: LocalIndex) -> Strategy:
    """The one place the configured name is read."""
    if cfg.strategy == "round_robin":
        return RoundRobin()
    if cfg.strategy == "least_load":
        return LeastLoad(cfg)
    if cfg.strategy == "prefix":
        return Prefix(cfg, history)
    assert cfg.strategy == "kv_aware" and index is not None, "kv_aware needs the index"
    return KVAware(cfg, index)
