"""The cluster-side controllers the emulator lacks: the Deployment controller and the
kubelet, reduced to what the operator observes (pods with IPs and Ready conditions,
Deployment status). Deterministic: call `settle()` or run `controllers()` in a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

from k8s_store import ApiError, Store

_ips = itertools.count(10)

# pod -> extra status fields (e.g. an Unschedulable condition) instead of Ready
PodFate = Callable[[dict[str, Any]], dict[str, Any] | None]


def _pods_by_owner(store: Store) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for pod in store.by_kind.get("/pods", {}).values():
        for ref in pod["metadata"].get("ownerReferences") or ():
            out.setdefault(ref["uid"], []).append(pod)
    return out


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions", ()))


def _sync_deployment(store: Store, api: Any, dep: dict[str, Any], fate: PodFate | None,
                     owned: list[dict[str, Any]]) -> None:
    pods_kind, deps_kind = api.kind("pods"), api.kind("deployments")
    ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
    template = dep["spec"]["template"]
    pods = sorted(owned, key=lambda p: p["metadata"]["name"])
    want = int(dep["spec"].get("replicas") or 0)
    for pod in pods[want:]:
        store.delete(pods_kind, ns, pod["metadata"]["name"])
    pods = pods[:want]
    for _ in range(len(pods), want):
        n = next(_ips)
        pod = {"metadata": {"name": f"{name}-{n:05d}", "namespace": ns,
                            "labels": dict(template["metadata"]["labels"]),
                            "annotations": dict(template["metadata"].get("annotations", {})),
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": name, "uid": dep["metadata"]["uid"],
                                                 "controller": True}]},
               "spec": template["spec"]}
        created = store.create(pods_kind, ns, pod)
        extra = fate(pod) if fate else None
        status = extra or {"phase": "Running", "podIP": f"10.1.{n // 250}.{n % 250 + 1}",
                           "conditions": [{"type": "PodScheduled", "status": "True"},
                                          {"type": "Ready", "status": "True"}]}
        pods.append(store.write(pods_kind, ns, pod["metadata"]["name"], "status",
                                {**created, "status": status}, None))
    ready = sum(1 for p in pods if _is_ready(p))
    status = {"observedGeneration": dep["metadata"]["generation"], "replicas": len(pods),
              "updatedReplicas": len(pods), "readyReplicas": ready, "availableReplicas": ready}
    if dep.get("status") != status:
        store.write(deps_kind, ns, name, "status", {**dep, "status": status}, None)


async def settle(api: Any, fate: PodFate | None = None) -> None:
    """One pass of the Deployment controller + kubelet over every Deployment."""
    def work(store: Store) -> None:
        owners = _pods_by_owner(store)
        for dep in list(store.by_kind.get("apps/deployments", {}).values()):
            try:
                _sync_deployment(store, api, dep, fate, owners.get(dep["metadata"]["uid"], []))
            except ApiError:
                pass  # deleted meanwhile: the next pass sees the new state
    await api.mutate(work)


@contextlib.asynccontextmanager
async def controllers(api: Any, interval: float = 0.05, fate: PodFate | None = None):
    """Run `settle` in the background while the block runs."""
    async def loop() -> None:
        while True:
            await settle(api, fate)
            await asyncio.sleep(interval)
    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
