"""Router: candidates -> filters -> scorers -> picker, per strategy (`strategies.py`).

The healthy pods are the candidates. A ranked strategy fills each candidate's
predicted prefix hits (the prompt's request keys, made per pod's key seed and
block size), its load (shared loads from the index's lookup when it gives them,
else this replica's scrapes) and this picker's in-flight counts; the soft
filters drop hot or full pods (never all of them); the weighted scores
(`scorers.py`) pick the pod; the runners-up, best first, are its fallbacks.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.load.table import LoadTable
from sluice.gateway.prompt.block_keys import key_seed, request_keys
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.config import RoutingConfig
from sluice.gateway.routing.filters import (
    Filter,
    ImbalanceGate,
    KVCeilingFilter,
    UnknownLoadFilter,
)
from sluice.gateway.routing.picker import MaxScorePicker
from sluice.gateway.routing.scorers import weighted
from sluice.gateway.routing.strategies import Strategy

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


class PodView(Protocol):
    """What the router reads about pods besides the index and the load table."""

    def is_healthy(self, pod: str) -> bool: ...

    def inflight(self, pod: str) -> int:
        """Requests this picker has in flight to the pod."""

    def pending_prefill(self, pod: str) -> int:
        """Uncached prompt tokens sent to the pod whose answers have not begun."""

    def block_size(self, pod: str) -> int | None:
        """The block size of the pod's KV events (the index's keys were made with it)."""

    def key_model(self, pod: str, model: str) -> str | None:
        """The name the pod's KV events key a request for `model` with: its base
        model's first served name (so an alias hashes alike), a LoRA adapter's own
        name; None: `model`."""


class Router:
    def __init__(self, cfg: RoutingConfig, strategy: Strategy, index: PrefixIndex | None,
                 loads: LoadTable, pods: PodView) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.index = index
        self.loads = loads
        self.pods = pods
        self.soft_filters: list[Filter] = [UnknownLoadFilter(), KVCeilingFilter(),
                                           ImbalanceGate()]
        self.picker = MaxScorePicker(cfg.seed)
        self._rr = itertools.count()

    def index_mode(self) -> str:
        return self.index.mode if self.index is not None else "none"

    async def route(self, model: str, token_ids: list[int], pods: list[str],
                    exclude: frozenset[str] = frozenset(),
                    cache_salt: str | None = None) -> Decision | None:
        """Choose a pod for a prompt, or None when no healthy pod is left."""
        strategy = self.strategy
        cands = [Candidate(p) for p in pods if p not in exclude and self.pods.is_healthy(p)]
        if not cands:
            return None
        if not strategy.ranked:
            i = next(self._rr) % len(cands)
            order = [c.pod for c in cands[i:] + cands[:i]]
            # no hits known: the whole prompt is the pod's to compute
            return Decision(order[0], strategy.name, 0, 0, self.index_mode(), "round robin",
                            prefill_tokens=len(token_ids), fallbacks=tuple(order[1:]))
        keys_by: dict[tuple[str, int], list[str]] = {}
        for c in cands:
            bs = c.block_size = self.pods.block_size(c.pod) or self.cfg.default_block_size
            seed = key_seed(self.pods.key_model(c.pod, model) or model, cache_salt)
            group = c.key_group = (seed, bs)
            if group not in keys_by:
                keys_by[group] = request_keys(seed, bs, token_ids)
            c.total_blocks = len(keys_by[group])
            c.prompt_tokens = len(token_ids)
        shared_loads = await self._fill_hits(cands, keys_by)
        now = time.time() * 1000.0
        for c in cands:
            # Redis's entry (with the lookup); Redis down or without it: the local one
            row = shared_loads.get(c.pod) if shared_loads is not None else None
            if row is None:
                row = self.loads.row(c.pod, now)
            if row is not None and now - row["ts_ms"] < self.loads.ttl_ms:
                c.waiting, c.running, c.kv_usage = row["waiting"], row["running"], row["kv_usage"]
            c.inflight = self.pods.inflight(c.pod)
            c.pending_prefill = self.pods.pending_prefill(c.pod)
            m = self.loads.metrics(c.pod)
            c.num_blocks = m.num_gpu_blocks if m is not None else None
        healthy = cands
        for f in self.soft_filters:
            cands = f(cands, self.cfg)
        scores = weighted(cands, strategy.parts)
        cold = max(c.hit_blocks for c in cands) == 0
        chosen = self.picker(cands, scores, self.cfg.cold_spread if cold else 1e-9)
        spec_keys = strategy.remember(chosen, keys_by[chosen.key_group])
        reason = "cold spread" if cold else "prefix+load"
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s -> %s (%s): %s", strategy.name, chosen.pod, reason, ", ".join(
                f"{c.pod} hit={c.hit_blocks}/{c.total_blocks} q={c.queue:g} "
                f"prefill={c.prefill_cost} "
                f"kv={c.kv_usage} room={c.cache_room} score={s:.3f}"
                for c, s in zip(cands, scores, strict=True)))
        return Decision(chosen.pod, strategy.name, chosen.hit_blocks, chosen.total_blocks,
                        self.index_mode(), reason, spec_keys, chosen.uncached_tokens,
                        _fallbacks(chosen, cands, scores, healthy))

    async def _fill_hits(self, cands: list[Candidate],
                         keys_by: dict[tuple[str, int], list[str]]
                         ) -> dict[str, dict[str, float]] | None:
        shared: dict[str, dict[str, float]] | None = None
        for key_group, keys in keys_by.items():
            bs = key_group[1]
            group = [c for c in cands if c.key_group == key_group]
            hits, loads, held = await self.strategy.hits(keys, [c.pod for c in group])
            if loads is not None:
                shared = {**(shared or {}), **loads}
            for c in group:
                # the engine always computes the prompt's last token (its logits are
                # sampled), so a block-aligned prompt reuses one block less than held
                reusable = (c.prompt_tokens - 1) // bs if c.prompt_tokens else 0
                c.hit_blocks = min(hits.get(c.pod, 0), reusable)
                c.held_blocks = held.get(c.pod, 0)
        return shared

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
