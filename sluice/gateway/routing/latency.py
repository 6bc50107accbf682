"""Sluice's latency-recorder: what each pod's answers took, for a latency scorer to read."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest, Served
from sluice.gateway.routing.registry import plugin

_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)


@dataclass(frozen=True)
class LatencyParams:
    # upper bounds of the prompt-length classes (tokens), the `prompt_tokens` label
    prompt_buckets: tuple[str, ...] = ("128", "512", "2048", "8192", "32768")

    def __post_init__(self) -> None:
        bounds = [int(b) for b in self.prompt_buckets]
        assert bounds == sorted(bounds) and bounds and bounds[0] > 0


@plugin("latency-recorder", LatencyParams)
class LatencyRecorder:
    """PostResponse: each streamed answer's time to first token and mean time per output
    token after it, into `sluice_gateway_request_ttft_seconds` and
    `sluice_gateway_request_tpot_seconds` by pod and prompt-length class (`le` of the
    class's upper bound, `+Inf` beyond). Measured where the data plane streams the answer
    to the picker (GIE's FULL_DUPLEX_STREAMED response mode; Sluice's Envoy with
    `EnvoyConfig.time_answers`): from the routing decision to the first body chunk, and
    over the SSE events after it."""

    def __init__(self, name: str, params: LatencyParams, ctx: PluginContext) -> None:
        self.name = name
        self.bounds = [int(b) for b in params.prompt_buckets]
        r = ctx.metrics if ctx.metrics is not None else CollectorRegistry()
        self.ttft = Histogram("sluice_gateway_request_ttft_seconds",
                              "Time to first token by pod and prompt length", 
                              ["pod", "prompt_tokens"], registry=r, buckets=_TTFT)
        self.tpot = Histogram("sluice_gateway_request_tpot_seconds",
                              "Mean time per output token after the first, by pod and "
                              "prompt length", ["pod", "prompt_tokens"], registry=r,
                              buckets=_TPOT)
        self._seen: set[tuple[str, str]] = set()

    def _class(self, tokens: int) -> str:
        return next((str(b) for b in self.bounds if tokens <= b), "+Inf")

    def post_response(self, req: RoutingRequest, served: Served) -> None:
        labels = (served.pod, self._class(served.prompt_tokens))
        self._seen.add(labels)
        if served.ttft_s is not None:
            self.ttft.labels(*labels).observe(served.ttft_s)
        if served.tpot_s is not None:
            self.tpot.labels(*labels).observe(served.tpot_s)

    def forget_pod(self, pod: str) -> None:
        for labels in [s for s in self._seen if s[0] == pod]:
            self._seen.discard(labels)
            for metric in (self.ttft, self.tpot):
                try:
                    metric.remove(*labels)
                except KeyError:
                    pass
