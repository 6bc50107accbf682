"""Soft filters: drop pods that should not take the request, never all of them.
(Unhealthy pods are never candidates: `Router.route`.)"""

from __future__ import annotations

from typing import Protocol

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.config import RoutingConfig


class Filter(Protocol):
    def __call__(self, cands: list[Candidate], cfg: RoutingConfig) -> list[Candidate]:
        """A sub-list of `cands`; `cands` itself rather than an empty list (fail open)."""


class KVCeilingFilter:
    """Soft: pods whose KV cache is (nearly) full would preempt; skip them."""

    def __call__(self, cands: list[Candidate], cfg: RoutingConfig) -> list[Candidate]:
        kept = [c for c in cands if c.kv_usage is None or c.kv_usage < cfg.kv_ceiling]
        return kept or cands


class UnknownLoadFilter:
    """Soft: a pod whose load entry expired (its /metrics went silent) is not
    preferred over pods whose load is known, whatever prefix it holds."""

    def __call__(self, cands: list[Candidate], cfg: RoutingConfig) -> list[Candidate]:
        kept = [c for c in cands if c.load_known]
        return kept or cands


class ImbalanceGate:
    """Soft: when load is imbalanced (max - min > abs and max > rel * min, SGLang's
    rule), pods above both thresholds are hot and dropped, so no prefix hit
    can pile more work on them."""

    def __call__(self, cands: list[Candidate], cfg: RoutingConfig) -> list[Candidate]:
        if len(cands) < 2:
            return cands
        queues = [c.queue for c in cands]
        lo, hi = min(queues), max(queues)
        if not (hi - lo > cfg.imbalance_abs and hi > cfg.imbalance_rel * lo):
            return cands
        kept = [c for c in cands
                if not (c.queue - lo > cfg.imbalance_abs and c.queue > cfg.imbalance_rel * lo)]
        return kept or cands
