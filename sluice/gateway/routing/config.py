"""Routing knobs (one frozen config per gateway)."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("round_robin", "least_load", "prefix", "kv_aware")


@dataclass(frozen=True)
class RoutingConfig:
    strategy: str = "kv_aware"
    w_prefix: float = 3.0          # weight of the prefix-hit fraction
    w_prefill: float = 2.0         # weight of the pending-prefill cost score
    w_queue: float = 2.0           # weight of the queue (waiting + running) score
    w_kv: float = 2.0              # weight of the free-KV score
    w_room: float = 2.0            # weight of the cache-room score (cache not yet filled)
    imbalance_abs: float = 16.0    # gate: max - min queue above this ...
    imbalance_rel: float = 1.5     # ... and max > rel * min  =>  hot pods are dropped
    kv_ceiling: float = 0.95       # pods at or above this KV usage are not candidates
    cold_spread: float = 0.25      # cold request: pick at random among scores this close
    speculative_ttl_ms: int = 2000  # kv_aware: routing decisions as short-lived index entries
    history_ttl_ms: int = 600_000  # prefix (approximate): how long a decision counts
    default_block_size: int = 16   # until a pod reports its own
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.strategy in STRATEGIES, self.strategy
        assert min(self.w_prefix, self.w_prefill, self.w_queue, self.w_kv, self.w_room) >= 0
        assert self.imbalance_abs >= 0 and self.imbalance_rel >= 1.0
        assert 0 < self.kv_ceiling <= 1.0 and self.cold_spread >= 0
        assert self.speculative_ttl_ms >= 0 and self.default_block_size > 0
