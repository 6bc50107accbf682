"""A stand-in for the kubelet on the tests' real API server. No node runs pods there, so
the pods that the real Deployment controller creates are reported Running and Ready with
an IP (or with the status `fate` gives), through the pods/status subresource, as a
kubelet reports them. Everything else (ReplicaSets, pod creation and deletion, Deployment
status, garbage collection) is kube-controller-manager's."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from sluice.operator import kube

_ips = itertools.count(10)

# pod -> its status (e.g. Pending and Unschedulable) instead of Running and Ready
PodFate = Callable[[dict[str, Any]], dict[str, Any] | None]


def ready_status(n: int) -> dict[str, Any]:
    return {"phase": "Running", "podIP": f"10.1.{n // 250}.{n % 250 + 1}",
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True"}]}


async def report(api: kube.KubeClient, namespace: str, fate: PodFate | None = None,
                 seen: set[str] | None = None) -> None:
    """One pass: every pod not reported yet gets its status."""
    seen = set() if seen is None else seen
    for pod in await api.list(kube.PODS, namespace):
        uid = pod["metadata"]["uid"]
        if uid in seen or pod["metadata"].get("deletionTimestamp"):
            continue
        status = (fate(pod) if fate else None) or ready_status(next(_ips))
        with contextlib.suppress(kube.NotFound):  # deleted meanwhile
            await api.patch(kube.PODS, namespace, pod["metadata"]["name"], {"status": status},
                            subresource="status")
        seen.add(uid)


@contextlib.asynccontextmanager
async def kubelet(api: kube.KubeClient, namespace: str, interval: float = 0.1,
                  fate: PodFate | None = None) -> AsyncIterator[None]:
    """Report the namespace's new pods every `interval` while the block runs."""
    seen: set[str] = set()

    async def loop() -> None:
        while True:
            await report(api, namespace, fate, seen)
            await asyncio.sleep(interval)
    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
