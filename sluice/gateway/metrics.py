"""The picker's own Prometheus metrics (served on its --metrics-port)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sluice.gateway.routing.profiles.pd import PREFILLED

_LAT = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("sluice_gateway_routing_decisions", "Routing decisions",
                                 ["strategy", "pod"], registry=r)
        self.hit_blocks = Histogram("sluice_gateway_predicted_hit_blocks",
                                    "Predicted prefix-hit blocks of routed requests",
                                    ["strategy"], registry=r,
                                    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.hit_ratio = Histogram("sluice_gateway_predicted_hit_ratio",
                                   "Predicted hit blocks / prompt blocks", ["strategy"],
                                   registry=r, buckets=(0, .1, .25, .5, .75, .9, .95, 1))
        self.route_seconds = Histogram("sluice_gateway_routing_seconds",
                                       "Tokenize + index lookup + scoring", registry=r,
                                       buckets=_LAT)
        self.tokenize_seconds = Histogram(  # (the first part of routing_seconds)
            "sluice_gateway_tokenize_seconds",
            "Prompt tokenization (own tokenizer, else a pod's /tokenize)", registry=r,
            buckets=_LAT)
        self.errors = Counter(  # kinds: bad_request, not_found, unknown_model, tokenize,
            # no_pod, shed, rate_limited, unauthorized (Envoy counts the upstream's own)
            "sluice_gateway_errors", "Errors by kind", ["kind"], registry=r)
        self.requests = Counter("sluice_gateway_requests", "Requests admitted, by API key name",
                                ["api_key"], registry=r)
        # prefill/decode pools: decision "prefill" (a prefill pod named in
        # x-prefiller-host-port) or "skipped", with why (routing/pd.py)
        self.pd_decisions = Counter("sluice_gateway_pd_decisions",
                                    "Disaggregation decisions in pools with prefill pods",
                                    ["decision", "reason"], registry=r)
        self.retries = Counter("sluice_gateway_retries", "Retries on another pod", registry=r)
        self.index_mode = Gauge("sluice_gateway_index_mode",
                                "1 for the index mode in use (redis / local / local_only)",
                                ["mode"], registry=r)
        self.pods = Gauge("sluice_gateway_pods", "Known engine pods", ["state"], registry=r)
        self.event_batches = Gauge("sluice_gateway_kv_event_batches",
                                   "KV event batches applied", registry=r)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: labels() validates and locks on every call
        (~2 us, several times per request)."""
        got = self._children.get((metric, labels))
        if got is None:
            got = self._children[(metric, labels)] = metric.labels(*labels)
        return got

    def decided(self, strategy: str, pod: str, hit_blocks: int, total_blocks: int) -> None:
        self.child(self.decisions, strategy, pod).inc()
        self.child(self.hit_blocks, strategy).observe(hit_blocks)
        if total_blocks:
            self.child(self.hit_ratio, strategy).observe(hit_blocks / total_blocks)

    def pd_decided(self, outcome: str) -> None:
        """`outcome`: `profiles.pd`'s PREFILLED, SHORT or NO_PREFILL_POD."""
        if outcome == PREFILLED:
            self.child(self.pd_decisions, "prefill", "uncached_at_threshold").inc()
        else:
            self.child(self.pd_decisions, "skipped", outcome).inc()

    def forget_pod(self, pod: str) -> None:
        """Drop a removed pod's series (pods come and go; series must not pile up)."""
        series = [(m, labels) for m, labels in self._children
                  if m is self.decisions and labels[-1] == pod]
        for metric, labels in series:
            self._children.pop((metric, labels), None)
            try:
                metric.remove(*labels)
            except KeyError:  # never observed
                pass

    def set_mode(self, mode: str) -> None:
        for m in ("redis", "local", "local_only"):
            self.index_mode.labels(m).set(1 if m == mode else 0)
