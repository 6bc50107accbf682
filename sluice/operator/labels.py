"""Labels, annotations and ports shared by the operator and the gateway (docs/contracts.md)."""

from __future__ import annotations

from sluice.operator import crd

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "app.kubernetes.io/managed-by"
COMPONENT = "app.kubernetes.io/component"
POOL = "sluice.dev/pool"
ROLE = "sluice.dev/role"

MODEL_ANNOTATION = "sluice.dev/model"
SPEC_HASH_ANNOTATION = "sluice.dev/spec-hash"

ENGINE_NAME = "sluice-engine"
OPERATOR_NAME = "sluice-operator"

HTTP_PORT = 8000
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
PORTS = (("http", HTTP_PORT), ("kv-events", KV_EVENTS_PORT), ("kv-replay", KV_REPLAY_PORT))

FINALIZER = "sluice.dev/index-cleanup"


def common_labels(pool: str) -> dict[str, str]:
    """Labels on every child of a pool (Deployments, Service, PDBs)."""
    return {NAME: ENGINE_NAME, INSTANCE: pool, MANAGED_BY: OPERATOR_NAME, POOL: pool}


def selector_labels(pool: str, role: str) -> dict[str, str]:
    """The immutable Deployment selector of one role."""
    return {POOL: pool, ROLE: role}


def pod_labels(pool: str, role: str) -> dict[str, str]:
    """Exactly the pod labels the gateway discovers engines by."""
    return {**common_labels(pool), ROLE: role}


def pool_selector(pool: str) -> str:
    """Label selector string for all engine pods (and children) of a pool."""
    return f"{MANAGED_BY}={OPERATOR_NAME},{POOL}={pool}"


def pool_selector_all() -> str:
    """Label selector for the children and engine pods of every pool."""
    return f"{MANAGED_BY}={OPERATOR_NAME},{POOL}"


def owner_reference(name: str, uid: str) -> dict[str, object]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}
