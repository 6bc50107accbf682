"""One InferencePool's engines: the pods its selector names, as GIE's EPP serves a pool.

Policy: `--pool-name` / `--pool-namespace` / `--pool-group` name one InferencePool. GIE's
(`inference.networking.k8s.io/v1`) gives `spec.selector.matchLabels` and the engines' port
(`spec.targetPorts[0].number`); Sluice's (`sluice.dev`) selects its own engine pods
(`labels.engine_selector`). Discovery then lists and watches only that namespace's pods
matching that selector, so a pod outside the pool is never a candidate, whatever it caches.
The pool object is read again every `refresh_s`: a changed selector or port replaces the
pod watch (and with it the endpoint set). A pool that does not exist or selects nothing
leaves no endpoints; one that cannot be read now (an API error, a lost connection) keeps
the set it had, and both are read again (logged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client as k8s

from sluice import labels

# The two InferencePool APIs (the operator's sluice/operator/kube.py names the same).
GIE_GROUP, GIE_VERSION = "inference.networking.k8s.io", "v1"
SLUICE_GROUP, SLUICE_VERSION = "sluice.dev", "v1alpha1"
VERSIONS = {GIE_GROUP: GIE_VERSION, SLUICE_GROUP: SLUICE_VERSION}
PLURAL = "inferencepools"


@dataclass(frozen=True)
class PoolRef:
    name: str
    namespace: str
    group: str = GIE_GROUP  # GIE's EPP default

    def __post_init__(self) -> None:
        if self.group not in VERSIONS:
            raise ValueError(f"--pool-group is one of {', '.join(VERSIONS)}: {self.group!r}")


@dataclass(frozen=True)
class PoolSelector:
    labels: str  # a label selector, as the API takes it
    port: int | None = None  # the engines' HTTP port; None: their `http` container port


def selector_of(ref: PoolRef, pool: dict[str, Any]) -> PoolSelector:
    """What `pool` (the API's JSON) selects; ValueError when it selects nothing."""
    if ref.group == SLUICE_GROUP:
        return PoolSelector(labels.engine_selector(ref.name))
    spec = pool.get("spec") or {}
    match = (spec.get("selector") or {}).get("matchLabels") or {}
    if not match:
        raise ValueError("spec.selector.matchLabels is empty")
    ports = spec.get("targetPorts") or []
    return PoolSelector(",".join(f"{k}={v}" for k, v in sorted(match.items())),
                        int(ports[0]["number"]) if ports else None)


class PoolUnusable(Exception):
    """The pool could not be read; `gone`: it does not exist or selects nothing (else the
    reading failed: not allowed, no connection). The message says which."""

    def __init__(self, message: str, gone: bool) -> None:
        super().__init__(message)
        self.gone = gone


async def read_selector(api: k8s.ApiClient, ref: PoolRef) -> PoolSelector:
    """The pool's selector now (PoolUnusable: why there is none)."""
    try:
        pool = await k8s.CustomObjectsApi(api).get_namespaced_custom_object(
            ref.group, VERSIONS[ref.group], ref.namespace, PLURAL, ref.name)
    except Exception as err:  # (404 until it is made, 403, a lost connection)
        raise PoolUnusable(getattr(err, "reason", None) or str(err),
                           gone=getattr(err, "status", None) == 404) from err
    try:
        return selector_of(ref, pool)
    except ValueError as err:
        raise PoolUnusable(str(err), gone=True) from err
