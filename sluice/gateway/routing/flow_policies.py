"""Flow-control plugin types an EndpointPickerConfig names from its `flowControl` and
`saturationDetector` sections: their parameters are checked here; `flow.config` and
`flow.saturation` read the sections themselves.

- `utilization-detector`: GIE's saturation detector; referenced in a profile it is
  also a soft filter: it keeps the pods with fresh load, fewer than
  `queueDepthThreshold` x (1 + headroom) waiting requests and less than
  `kvCacheUtilThreshold` x (1 + headroom) KV usage, all of them when none is left;
- `round-robin-fairness-policy`, `global-strict-fairness-policy`: how a priority band
  is shared between tenants (`flow.queues`);
- `fcfs-ordering-policy`: a tenant's requests in arrival order;
- `concurrency-detector`: GIE's other saturation detector, the requests in flight to
  the pool over `maxConcurrency` per pod; in a profile, a soft filter keeping the pods
  with fewer than `maxConcurrency` x (1 + headroom) of this picker's requests in flight;
- `static-usage-limit-policy`: every priority is dispatched while the pool's
  saturation is below `threshold`;
- `priority-holdback-policy`: the limit falls linearly over the priorities' ranks, from
  `maxCeiling` for the highest to `minCeiling` for the lowest (`flow.config`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sluice.gateway.flow.fields import duration_s
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@dataclass(frozen=True)
class UtilizationParams:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold: str = "200ms"
    headroom: float = 0.0

    def __post_init__(self) -> None:
        assert self.queue_depth_threshold > 0 and 0 < self.kv_cache_util_threshold <= 1
        assert duration_s(self.metrics_staleness_threshold, "metricsStalenessThreshold") > 0
        assert self.headroom >= 0


@plugin("utilization-detector", UtilizationParams)
class UtilizationDetector:
    """See the module docstring (a pod's load is fresh when its row is younger than
    `metricsStalenessThreshold`)."""

    def __init__(self, name: str, params: UtilizationParams, ctx: PluginContext) -> None:
        self.name = name
        self.queue = params.queue_depth_threshold * (1.0 + params.headroom)
        self.kv = params.kv_cache_util_threshold * (1.0 + params.headroom)
        self.stale_ms = duration_s(params.metrics_staleness_threshold, "") * 1000.0

    def filter(self, req: RoutingRequest, cands: list[Candidate]) -> list[Candidate]:
        now = time.time() * 1000.0
        kept = [c for c in cands if c.waiting is not None and c.kv_usage is not None
                and now - c.load_ts_ms <= self.stale_ms
                and c.waiting < self.queue and c.kv_usage < self.kv]
        return kept or cands


@dataclass(frozen=True)
class ConcurrencyParams:
    concurrency_mode: str = "requests"
    max_concurrency: int = 100
    max_token_concurrency: int = 1_000_000  # (the tokens mode's; not served)
    headroom: float = 0.0
    IGNORED = ("inFlightLoadProducerName",)

    def __post_init__(self) -> None:
        assert self.concurrency_mode == "requests", "concurrencyMode: only 'requests'"
        assert self.max_concurrency > 0 and self.headroom >= 0


@plugin("concurrency-detector", ConcurrencyParams)
class ConcurrencyDetector:
    """See the module docstring."""

    def __init__(self, name: str, params: ConcurrencyParams, ctx: PluginContext) -> None:
        self.name = name
        self.limit = params.max_concurrency * (1.0 + params.headroom)

    def filter(self, req: RoutingRequest, cands: list[Candidate]) -> list[Candidate]:
        kept = [c for c in cands if c.inflight < self.limit]
        return kept or cands


@dataclass(frozen=True)
class UsageLimitParams:
    threshold: float = 1.0

    def __post_init__(self) -> None:
        assert 0 < self.threshold <= 1.0


@dataclass(frozen=True)
class HoldbackParams:
    min_ceiling: float = 0.0  # required (> 0)
    max_ceiling: float = 1.0
    shape: str = "linear"
    domain: str = "rank"

    def __post_init__(self) -> None:
        assert 0 < self.min_ceiling <= self.max_ceiling <= 1.0, "0 < minCeiling <= maxCeiling <= 1"
        assert (self.shape, self.domain) == ("linear", "rank"), "shape linear, domain rank"


class Policy:
    """A flow-control policy named by the configuration (read by `flow.config`)."""

    def __init__(self, name: str, params: object, ctx: PluginContext) -> None:
        self.name = name


class UsageLimit(Policy):
    def __init__(self, name: str, params: object, ctx: PluginContext) -> None:
        self.name, self.params = name, params


plugin("static-usage-limit-policy", UsageLimitParams)(
    type("StaticUsageLimitPolicy", (UsageLimit,), {}))
plugin("priority-holdback-policy", HoldbackParams)(
    type("PriorityHoldbackPolicy", (UsageLimit,), {}))
for _type in ("round-robin-fairness-policy", "global-strict-fairness-policy",
              "fcfs-ordering-policy"):
    plugin(_type, NoParams)(type("".join(w.title() for w in _type.split("-")), (Policy,), {}))
