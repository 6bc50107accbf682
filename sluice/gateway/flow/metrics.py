"""Flow control's Prometheus metrics: GIE's names where GIE has the metric.

GIE labels its flow-control metrics with the fairness id and the model too; both are
dropped here (a tenant per API key, or a header's value, has no bound), leaving the pool,
the priority and the outcome, a set the configuration bounds.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# GIE's buckets for flow_control_request_queue_duration_seconds
_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0, 30.0, 60.0)
# Shed reasons -> GIE's QueueOutcome names (`types/outcomes.go`); "evicted" (a higher
# priority took the place) and "sheddable" are Sluice's, under GIE's catch-alls.
OUTCOMES = {"dispatched": "Dispatched", "capacity": "RejectedCapacity", "ttl": "EvictedTTL",
            "cancelled": "EvictedContextCancelled", "evicted": "EvictedOther",
            "sheddable": "RejectedOther"}


class FlowMetrics:
    """Every admit() is counted once, when it ends: in the queue-time histogram (by
    outcome; 0 s for one admitted at once) and in the dispatched or shed counter (a
    cancelled one in the histogram only). The queue gauges follow each push and remove."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.queue_seconds = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time requests spend in flow control, from arrival to their outcome",
            ["inference_pool", "priority", "outcome"], registry=r, buckets=_QUEUE_BUCKETS)
        self.queue_size = Gauge("inference_extension_flow_control_queue_size",
                                "Requests waiting in flow control's queues",
                                ["inference_pool", "priority"], registry=r)
        self.queue_bytes = Gauge("inference_extension_flow_control_queue_bytes",
                                 "Bytes of the requests waiting in flow control's queues",
                                 ["inference_pool", "priority"], registry=r)
        self.dispatched = Counter("sluice_gateway_flow_dispatched",
                                  "Requests flow control let through (at once or queued)",
                                  ["inference_pool", "priority"], registry=r)
        self.shed = Counter("sluice_gateway_flow_shed", "Requests flow control refused",
                            ["inference_pool", "priority", "reason"], registry=r)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: labels() validates and locks on every call."""
        got = self._children.get((metric, labels))
        if got is None:
            got = self._children[(metric, labels)] = metric.labels(*labels)
        return got

    def ended(self, pool: str, priority: int, reason: str, waited_s: float) -> None:
        """One admit() ended: `reason` is "dispatched", "cancelled" or a shed reason."""
        prio = str(priority)
        self.child(self.queue_seconds, pool, prio, OUTCOMES[reason]).observe(waited_s)
        if reason == "dispatched":
            self.child(self.dispatched, pool, prio).inc()
        elif reason != "cancelled":
            self.child(self.shed, pool, prio, reason).inc()

    def queued(self, pool: str, priority: int, size: int, sign: int) -> None:
        prio = str(priority)
        self.child(self.queue_size, pool, prio).inc(sign)
        if size:
            self.child(self.queue_bytes, pool, prio).inc(sign * size)
