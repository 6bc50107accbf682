"""Kubernetes labels, annotations and ports of engine pods: the one contract between the
operator, which renders them, and the gateway's discovery, which selects and reads them
(docs/contracts.md). Pure: no imports beyond the standard library, so the picker's image
(no engine, no torch) and the operator's both carry it.

`tests/test_labels.py` pins it: the pods the operator renders are exactly the pods the
discovery selector matches, and the discovery reads their ports and model from them.
"""

from __future__ import annotations

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "app.kubernetes.io/managed-by"
COMPONENT = "app.kubernetes.io/component"
POOL = "sluice.dev/pool"
ROLE = "sluice.dev/role"  # serve, prefill or decode
LLMD_ROLE = "llm-d.ai/role"  # llm-d's: prefill, decode or both (the picker reads it too)

MODEL_ANNOTATION = "sluice.dev/model"  # model names are not valid label values
SPEC_HASH_ANNOTATION = "sluice.dev/spec-hash"
# "true": the pod's KV-event sockets are CURVE servers; "false": plain (vLLM pools, which
# cannot do CURVE, behind the NetworkPolicy). Absent: the picker's own default.
KV_EVENTS_CURVE_ANNOTATION = "sluice.dev/kv-events-curve"

ENGINE_NAME = "sluice-engine"
OPERATOR_NAME = "sluice-operator"

HTTP_PORT = 8000
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
PORTS = (("http", HTTP_PORT), ("kv-events", KV_EVENTS_PORT), ("kv-replay", KV_REPLAY_PORT))
KV_TRANSFER_PORT = 14579  # prefill/decode pools: prefill engines serve KV blocks here


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


def engine_selector(pool: str | None = None) -> str:
    """What the gateway's discovery lists: engine pods (of one pool, when given)."""
    return f"{NAME}={ENGINE_NAME}" + (f",{POOL}={pool}" if pool else "")
