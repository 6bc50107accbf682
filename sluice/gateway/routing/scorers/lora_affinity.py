"""GIE's lora-affinity-scorer."""

from __future__ import annotations

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import NoParams, plugin


@plugin("lora-affinity-scorer", NoParams)
class LoraAffinityScorer:
    """From the pod's `vllm:lora_requests_info`: 1.0 when the request's adapter (its
    `model`) is running there, 0.8 when the pod has room for one more adapter (running +
    waiting adapters < max_lora), 0.6 when the adapter waits there, else 0. A pod that
    reports no LoRA gauge scores 0."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        def one(c: Candidate) -> float:
            if req.model in c.running_loras:
                return 1.0
            if c.max_loras is not None and (len(c.running_loras) + len(c.waiting_loras)
                                            < c.max_loras):
                return 0.8
            return 0.6 if req.model in c.waiting_loras else 0.0
        return [one(c) for c in cands]
