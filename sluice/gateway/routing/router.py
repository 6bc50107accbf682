"""Router: candidates -> filters -> scorers -> picker, per strategy.

- round_robin: healthy pods in turn.
- least_load: filters, then queue + KV scores.
- prefix (approximate): hits from this gateway's own routing history only.
- kv_aware (precise): hits from the event-fed index (the replica's view, which
  mirrors the other replicas' decisions, or Redis with `--index-reads redis`)
  plus the shared loads (read from Redis by the lookup or with each scrape);
  the decision is written back as speculative entries (TTL
  `speculative_ttl_ms`) so a burst of one prefix sticks to one pod before the
  engine's events arrive; the picker renews them (`renew_speculation`) while
  the request's prefill is still pending, since a prefill can outlast the TTL
  on a loaded engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluice.gateway.block_keys import key_seed, request_keys
from sluice.gateway.load import LoadTable
from sluice.gateway.local_index import LocalIndex
from sluice.gateway.prefix_index import PrefixIndex
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.config import RoutingConfig
from sluice.gateway.routing.filters import (
    HealthyFilter,
    ImbalanceGate,
    KVCeilingFilter,
    UnknownLoadFilter,
)
from sluice.gateway.routing.picker import MaxScorePicker
from sluice.gateway.routing.scorers import (
    CacheRoomScorer,
    KVUsageScorer,
    PrefillCostScorer,
    PrefixScorer,
    QueueScorer,
    weighted,
)

log = logging.getLogger("sluice.gateway.routing")


@dataclass(frozen=True)
class Decision:
    pod: str
    strategy: str
    hit_blocks: int
    total_blocks: int
    index_mode: str
    reason: str
    spec_keys: tuple[str, ...] = ()  # written as speculative entries (kv_aware)
    prefill_tokens: int = 0          # the prompt's tokens the pod must compute
    fallbacks: tuple[str, ...] = ()  # the other healthy pods, best first (retries)


class Router:
    def __init__(self, cfg: RoutingConfig, index: PrefixIndex | None, history: LocalIndex,
                 loads: LoadTable, is_healthy: Callable[[str], bool],
                 inflight: Callable[[str], int],
                 block_size_of: Callable[[str], int | None],
                 pending_prefill: Callable[[str], int] = lambda pod: 0,
                 key_model_of: Callable[[str, str], str | None] = lambda pod, model: None
                 ) -> None:
        """`key_model_of(pod, model)`: the name the pod's KV events key a request for
        `model` with (its base model's first served name, so a request naming an
        alias hashes alike; a LoRA adapter's own name; None: `model`)."""
        assert cfg.strategy != "kv_aware" or index is not None
        self.cfg = cfg
        self.index = index
        self.history = history
        self.loads = loads
        self.inflight = inflight
        self.pending_prefill = pending_prefill
        self.block_size_of = block_size_of
        self.key_model_of = key_model_of
        self.healthy = HealthyFilter(is_healthy)
        self.soft_filters = [UnknownLoadFilter(), KVCeilingFilter(), ImbalanceGate()]
        self.picker = MaxScorePicker(cfg.seed)
        self._rr = itertools.count()
        c = cfg
        self.parts = {"least_load": [(c.w_queue, QueueScorer()), (c.w_kv, KVUsageScorer())],
                      "prefix": [(c.w_prefix, PrefixScorer()),
                                 (c.w_prefill, PrefillCostScorer()),
                                 (c.w_queue, QueueScorer()), (c.w_kv, KVUsageScorer())]}
        self.parts["kv_aware"] = [*self.parts["prefix"], (c.w_room, CacheRoomScorer())]

    def index_mode(self) -> str:
        return self.index.mode if self.index is not None else "none"

    async def route(self, model: str, token_ids: list[int], pods: list[str],
                    exclude: frozenset[str] = frozenset(),
                    cache_salt: str | None = None) -> Decision | None:
        """Choose a pod for a prompt, or None when no healthy pod is left."""
        strategy = self.cfg.strategy
        cands = self.healthy([Candidate(p) for p in pods if p not in exclude], self.cfg)
        if not cands:
            return None
        if strategy == "round_robin":
            i = next(self._rr) % len(cands)
            order = [c.pod for c in cands[i:] + cands[:i]]
            return Decision(order[0], strategy, 0, 0, self.index_mode(), "round robin",
                            fallbacks=tuple(order[1:]))
        keys_by: dict[tuple[str, int], list[str]] = {}
        for c in cands:
            bs = c.block_size = self.block_size_of(c.pod) or self.cfg.default_block_size
            group = c.key_group = (key_seed(self.key_model_of(c.pod, model) or model, cache_salt), bs)
            if group not in keys_by:
                keys_by[group] = request_keys(group[0], bs, token_ids)
            c.total_blocks = len(keys_by[group])
            c.prompt_tokens = len(token_ids)
        shared_loads = await self._fill_hits(strategy, cands, keys_by)
        now = time.time() * 1000.0
        loads = shared_loads
        if loads is None or any(c.pod not in loads for c in cands):
            # Redis down, or without some pod's entry: local scrapes fill the gaps
            loads = {**self.loads.fresh(now), **(loads or {})}
        for c in cands:
            row = loads.get(c.pod)
            if row is not None and now - row["ts_ms"] < self.loads.ttl_ms:
                c.waiting, c.running, c.kv_usage = row["waiting"], row["running"], row["kv_usage"]
            c.inflight = self.inflight(c.pod)
            c.pending_prefill = self.pending_prefill(c.pod)
            m = self.loads.metrics(c.pod)
            c.num_blocks = m.num_gpu_blocks if m is not None else None
        healthy = cands
        for f in self.soft_filters:
            cands = f(cands, self.cfg)
        scores = weighted(cands, self.parts[strategy])
        cold = max(c.hit_blocks for c in cands) == 0
        chosen = self.picker(cands, scores, self.cfg.cold_spread if cold else 1e-9)
        spec_keys = self._remember(strategy, chosen, keys_by)
        reason = "cold spread" if cold else "prefix+load"
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s -> %s (%s): %s", strategy, chosen.pod, reason, ", ".join(
                f"{c.pod} hit={c.hit_blocks}/{c.total_blocks} q={c.queue:g} "
                f"prefill={c.prefill_cost} "
                f"kv={c.kv_usage} room={c.cache_room} score={s:.3f}"
                for c, s in zip(cands, scores)))
        return Decision(chosen.pod, strategy, chosen.hit_blocks, chosen.total_blocks,
                        self.index_mode(), reason, spec_keys, chosen.uncached_tokens,
                        _fallbacks(chosen, cands, scores, healthy))

    async def _fill_hits(self, strategy: str, cands: list[Candidate],
                         keys_by: dict[tuple[str, int], list[str]]
                         ) -> dict[str, dict[str, float]] | None:
        shared: dict[str, dict[str, float]] | None = None
        if strategy not in ("prefix", "kv_aware"):
            return None
        for key_group, keys in keys_by.items():
            bs = key_group[1]
            group = [c for c in cands if c.key_group == key_group]
            pods = [c.pod for c in group]
            held: dict[str, int] = {}
            if strategy == "kv_aware":
                assert self.index is not None
                hits, loads, held = await self.index.lookup(keys, pods)
                if loads is not None:
                    shared = {**(shared or {}), **loads}
            else:
                hits = self.history.lookup(keys, pods, time.time() * 1000.0)
            for c in group:
                # the engine always computes the prompt's last token (its logits are
                # sampled), so a block-aligned prompt reuses one block less than held
                reusable = (c.prompt_tokens - 1) // bs if c.prompt_tokens else 0
                c.hit_blocks = min(hits.get(c.pod, 0), reusable)
                c.held_blocks = held.get(c.pod, 0)
        return shared

    def _remember(self, strategy: str, chosen: Candidate,
                  keys_by: dict[tuple[str, int], list[str]]) -> tuple[str, ...]:
        """Record the decision; the keys written as speculative entries."""
        keys = keys_by[chosen.key_group]
        if strategy == "prefix":
            self.history.add_speculative(chosen.pod, keys,
                                         time.time() * 1000.0 + self.cfg.history_ttl_ms)
        elif strategy == "kv_aware" and self.index is not None and self.cfg.speculative_ttl_ms:
            spec = keys[chosen.hit_blocks:]
            self.index.speculate(chosen.pod, spec, self.cfg.speculative_ttl_ms)
            return tuple(spec)
        return ()

    def renew_speculation(self, d: Decision) -> None:
        """The decision's speculative entries last `speculative_ttl_ms` from now."""
        if d.spec_keys and self.index is not None:
            self.index.speculate(d.pod, list(d.spec_keys), self.cfg.speculative_ttl_ms)


def _fallbacks(chosen: Candidate, cands: list[Candidate], scores: list[float],
               healthy: list[Candidate]) -> tuple[str, ...]:
    """The pods to try after `chosen`: those the soft filters kept, by score, then
    the healthy ones they had set aside (better an overloaded pod than none)."""
    ranked = [c.pod for _, c in sorted(zip(scores, cands, strict=True), key=lambda sc: -sc[0])]
    kept = set(ranked)
    order = ranked + [c.pod for c in healthy if c.pod not in kept]
    return tuple(p for p in order if p != chosen.pod)
