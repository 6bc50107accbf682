"""llm-d's probabilistic-admitter."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class ProbabilisticParams:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    power: float = 5.0
    k: float = 300.0

    def __post_init__(self) -> None:
        assert self.queue_depth_threshold > 0 and 0 < self.kv_cache_util_threshold <= 1
        assert self.power > 0 and self.k >= 0


@plugin("probabilistic-admitter", ProbabilisticParams)
class ProbabilisticAdmitter:
    """Sheddable requests (priority < 0) only; others always pass. saturation = the mean
    over the pool's pods of max(waiting / queueDepthThreshold, KV usage /
    kvCacheUtilThreshold), 1 for a pod whose load is unknown; the request is refused
    (429) with probability min(saturation^power x k, 1): rarely while the pool has
    room, surely well before it is full."""

    def __init__(self, name: str, params: ProbabilisticParams, ctx: PluginContext) -> None:
        self.name, self.p = name, params
        self._rng = random.Random(ctx.seed)

    def saturation(self, rows: list[dict[str, float] | None]) -> float:
        p = self.p
        each = [1.0 if r is None else max(r["waiting"] / p.queue_depth_threshold,
                                          r["kv_usage"] / p.kv_cache_util_threshold)
                for r in rows]
        return sum(each) / len(each) if each else 1.0

    def admit_sheddable(self, rows: list[dict[str, float] | None]) -> bool:
        refuse = min(self.saturation(rows) ** self.p.power * self.p.k, 1.0)
        return self._rng.random() >= refuse
