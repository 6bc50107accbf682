"""KV-transfer metrics, registered beside the engine's own (one registry per engine).

sluice:kv_transfer_bytes_total{direction}       bytes of KV sent (producer) / received
sluice:kv_transfer_time_seconds{direction}      one pull, request to last block written
sluice:kv_transfer_fallbacks_total{reason}      decode requests that prefilled locally
                                                 (reason: transfer_failed | prefill_leg)
sluice:kv_blocks_held_for_remote                blocks a producer holds for a pull
sluice:kv_transfer_requests_total{outcome}      producer holds: pulled | expired | refused
Updated on the core thread only (transfer threads hand their figures over in results).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TIME = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.model_name = model_name
        self.bytes = Counter("sluice:kv_transfer_bytes", "KV-cache bytes moved between "
                             "engines", labels + ["direction"], registry=registry)
        self.time = Histogram("sluice:kv_transfer_time_seconds", "Time of one KV pull",
                              labels + ["direction"], buckets=_TIME, registry=registry)
        self.fallbacks = Counter("sluice:kv_transfer_fallbacks", "Disaggregated requests "
                                 "prefilled locally instead", labels + ["reason"],
                                 registry=registry)
        self.held = Gauge("sluice:kv_blocks_held_for_remote", "KV blocks held for a remote "
                          "pull", labels, registry=registry).labels(model_name)
        self.holds = Counter("sluice:kv_transfer_requests", "Held requests by how their "
                             "hold ended", labels + ["outcome"], registry=registry)
        for d in ("sent", "received"):
            self.bytes.labels(model_name, d)
            self.time.labels(model_name, d)
        for r in ("transfer_failed", "prefill_leg"):
            self.fallbacks.labels(model_name, r)
        for o in ("pulled", "expired", "refused"):
            self.holds.labels(model_name, o)

    def transferred(self, direction: str, num_bytes: int, seconds: float) -> None:
        self.bytes.labels(self.model_name, direction).inc(num_bytes)
        self.time.labels(self.model_name, direction).observe(seconds)

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(self.model_name, reason).inc()

    def hold_ended(self, outcome: str) -> None:
        self.holds.labels(self.model_name, outcome).inc()
