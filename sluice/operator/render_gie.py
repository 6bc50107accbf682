"""GIE mode: per sluice pool, the Gateway API Inference Extension's `InferencePool`.

With it, any Gateway that implements GIE (Envoy Gateway, Istio, kgateway, GKE) can route an
HTTPRoute to a sluice pool: the GIE pool selects the pool's engine pods and names Sluice's
endpoint picker (`sluice epp`, a Service in the same namespace) as its `endpointPickerRef`.
It is one more owned child of the sluice pool (same name, other API group), so deleting the
sluice pool garbage-collects it. `render_gie_pool` is pure, like `render.render_pool`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice import labels
from sluice.operator import kube
from sluice.operator.render import Manifest, owner_reference, spec_hash
from sluice.operator.spec import PoolSpec

GIE_POOLS = kube.GIE_POOLS
GROUP, VERSION = GIE_POOLS.group, GIE_POOLS.version
KIND = "InferencePool"
FAILURE_MODES = ("FailOpen", "FailClose")
DEFAULT_PICKER_PORT = 9002  # GIE's default ext_proc port, and `sluice epp --grpc-port`'s


@dataclass(frozen=True)
class GieConfig:
    """Operator-wide GIE settings (`sluice operator --gie-endpoint-picker ...`)."""

    picker_service: str  # the picker's Service, looked up in each pool's own namespace
    picker_port: int = DEFAULT_PICKER_PORT
    failure_mode: str = "FailClose"  # no picker answer: refuse, never guess an endpoint
    # Only pools here get a GIE pool: the reference is namespace-local, so elsewhere it would
    # name a Service that does not exist. None: every namespace.
    namespace: str | None = None
    # The chart's picker Deployment, cloned per pool as its own scoped picker (render_epp);
    # None: every GIE pool names `picker_service`.
    picker_template: str | None = None

    def __post_init__(self) -> None:
        if not self.picker_service:
            raise ValueError("GIE mode needs the endpoint picker's Service name")
        if self.failure_mode not in FAILURE_MODES:
            raise ValueError(f"failure mode must be one of {FAILURE_MODES}")
        if not 1 <= self.picker_port <= 65535:
            raise ValueError(f"picker port {self.picker_port} is not a TCP port")

    def applies_to(self, namespace: str) -> bool:
        return self.namespace is None or self.namespace == namespace


def engine_selector(pool: str) -> dict[str, str]:
    """Every engine pod of the pool, all roles: the same set the picker discovers."""
    return {labels.NAME: labels.ENGINE_NAME, labels.POOL: pool}


def render_gie_pool(pool: PoolSpec, config: GieConfig, picker: str | None = None) -> Manifest:
    """The `inference.networking.k8s.io/v1` InferencePool mirroring `pool`; its endpoint
    picker is the Service `picker` (the pool's own, render_epp), else `config`'s."""
    manifest: Manifest = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {
            "name": pool.name, "namespace": pool.namespace,
            "labels": labels.common_labels(pool.name), "annotations": {},
            "ownerReferences": [owner_reference(pool.name, pool.uid)],
        },
        "spec": {
            "selector": {"matchLabels": engine_selector(pool.name)},
            "targetPorts": [{"number": labels.HTTP_PORT}],
            # Defaults spelled out: the live object then equals what we wrote (no drift loop
            # against the API server's defaulting).
            "endpointPickerRef": {
                "group": "", "kind": "Service", "name": picker or config.picker_service,
                "port": {"number": config.picker_port},
                "failureMode": config.failure_mode,
            },
        },
    }
    manifest["metadata"]["annotations"][labels.SPEC_HASH_ANNOTATION] = spec_hash(manifest)
    return manifest
