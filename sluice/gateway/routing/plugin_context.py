"""What plugin factories are given: the picker's shared state they may read or feed."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from sluice.gateway.index.prefix_index import PrefixIndex


@dataclass(frozen=True)
class PluginContext:
    # the event-fed prefix index (None: the picker runs without one, e.g. in unit tests
    # of plugins that do not read it)
    index: PrefixIndex | None = None
    load_ttl_ms: int = 1000  # a load entry older than this is unknown
    metrics: CollectorRegistry | None = None  # where plugins' own metrics go
    seed: int = 0  # random pickers and tie breaks (reproducible tests)
