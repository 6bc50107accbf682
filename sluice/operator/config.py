"""Operator-wide settings (from `sluice operator` flags), frozen."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.operator.render import RenderConfig
from sluice.operator.render_gie import GieConfig
from sluice.operator.retry import Backoff


@dataclass(frozen=True)
class OperatorConfig:
    render: RenderConfig = field(default_factory=RenderConfig)
    namespaces: tuple[str, ...] = ()  # empty: all namespaces (cluster-wide)
    peering_name: str = "sluice"
    standalone: bool = False  # no peering: only for tests and single-replica runs
    # kopf peering: the live operator with the highest priority acts; equal priorities
    # make *all* of them pause, so every replica must have its own (random by default).
    priority: int = 0
    resync_interval_s: float = 60.0  # safety-net reconcile per pool
    # retries of failed passes: 0.5 s doubling, 30 s at most
    backoff: Backoff = field(default_factory=Backoff)
    autoscale_interval_s: float = 15.0
    metrics_timeout_s: float = 2.0
    redis_url: str | None = None  # the gateway's Redis; None: no index finalizer
    liveness_endpoint: str | None = None  # e.g. http://0.0.0.0:8080/healthz
    gie: GieConfig | None = None  # GIE mode (a GIE InferencePool per pool); None: off
    # The engines' own key, sent with the LoRA load requests (lora.py); None: keyless engines
    engine_api_key: str | None = field(default=None, repr=False)

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces
