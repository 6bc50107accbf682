"""Test helpers (no tests here): a router over a scripted view of the pods."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.load.table import LoadTable
from sluice.gateway.routing.config import RoutingConfig
from sluice.gateway.routing.router import Router
from sluice.gateway.routing.strategies import make_strategy


@dataclass
class Pods:
    """A `PodView` whose answers the test sets."""

    unhealthy: Collection[str] = ()
    inflight_by: dict[str, int] = field(default_factory=dict)
    pending_by: dict[str, int] = field(default_factory=dict)
    block_sizes: dict[str, int] = field(default_factory=dict)
    default_block_size: int | None = 16
    key_model_of: Callable[[str, str], str | None] = lambda pod, model: None

    def is_healthy(self, pod: str) -> bool:
        return pod not in self.unhealthy

    def inflight(self, pod: str) -> int:
        return self.inflight_by.get(pod, 0)

    def pending_prefill(self, pod: str) -> int:
        return self.pending_by.get(pod, 0)

    def block_size(self, pod: str) -> int | None:
        return self.block_sizes.get(pod, self.default_block_size)

    def key_model(self, pod: str, model: str) -> str | None:
        return self.key_model_of(pod, model)


def make_router(cfg: RoutingConfig, index: PrefixIndex, table: LoadTable,
                pods: Pods | None = None) -> Router:
    strategy = make_strategy(cfg, index, LocalIndex())
    return Router(cfg, strategy, index, table, pods or Pods())
