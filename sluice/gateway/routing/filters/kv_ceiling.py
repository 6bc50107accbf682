"""Soft filter: pods whose KV cache is (nearly) full."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class KVCeilingParams:
    threshold: float = 0.95  # KV usage at or above which a pod is skipped

    def __post_init__(self) -> None:
        assert 0 < self.threshold <= 1.0


@plugin("kv-cache-ceiling-filter", KVCeilingParams)
class KVCeilingFilter:
    """Soft: pods whose KV cache is (nearly) full would preempt; skip them. A pod
    whose usage is unknown is kept."""

    def __init__(self, name: str, params: KVCeilingParams, ctx: PluginContext) -> None:
        self.name, self.threshold = name, params.threshold

    def filter(self, req: RoutingRequest, cands: list[Candidate]) -> list[Candidate]:
        kept = [c for c in cands if c.kv_usage is None or c.kv_usage < self.threshold]
        return kept or cands
