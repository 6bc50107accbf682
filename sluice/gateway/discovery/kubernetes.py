"""Kubernetes discovery: ready engine pods of InferencePools, via list + watch.

Selects pods labelled `app.kubernetes.io/name=sluice-engine` (and
`sluice.dev/pool=<pool>` when a pool is given) in one namespace. A pod counts
when it has an IP, is not being deleted and its Ready condition is True. The
model is the `sluice.dev/model` annotation; ports are the container ports named
`http` / `kv-events` / `kv-replay` (defaults 8000 / 5557 / 5558). The watch
runs on a thread (the `kubernetes` client is synchronous) and re-lists after
any error or expiry, with a capped backoff.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from sluice.gateway.discovery.static import Endpoint, OnChange

log = logging.getLogger("sluice.gateway.k8s")

APP_LABEL = "app.kubernetes.io/name=sluice-engine"
POOL_LABEL = "sluice.dev/pool"
MODEL_ANNOTATION = "sluice.dev/model"
DEFAULT_PORTS = {"http": 8000, "kv-events": 5557, "kv-replay": 5558}


def _get(obj: Any, *path: str) -> Any:
    """Attribute or dict access (client objects or raw dicts from a fake API)."""
    for name in path:
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def pod_endpoint(pod: Any, namespace: str) -> Endpoint | None:
    """The pod's Endpoint when it is ready to serve, else None."""
    if _get(pod, "metadata", "deletion_timestamp"):
        return None
    ip = _get(pod, "status", "pod_ip")
    conds = _get(pod, "status", "conditions") or []
    if not ip or not any(_get(c, "type") == "Ready" and _get(c, "status") == "True"
                         for c in conds):
        return None
    ports = dict(DEFAULT_PORTS)
    for container in _get(pod, "spec", "containers") or []:
        for p in _get(container, "ports") or []:
            if _get(p, "name") in ports:
                ports[_get(p, "name")] = int(_get(p, "container_port"))
    labels = _get(pod, "metadata", "labels") or {}
    annotations = _get(pod, "metadata", "annotations") or {}
    host = f"[{ip}]" if ":" in ip else ip
    return Endpoint(pod=f"{host}:{ports['http']}", url=f"http://{host}:{ports['http']}",
                    model=annotations.get(MODEL_ANNOTATION), pool=labels.get(POOL_LABEL, ""),
                    namespace=namespace, events=f"tcp://{host}:{ports['kv-events']}",
                    replay=f"tcp://{host}:{ports['kv-replay']}")


class KubernetesDiscovery:
    def __init__(self, namespace: str, pool: str | None = None, core_v1: Any = None,
                 watch_factory: Callable[[], Any] | None = None,
                 watch_timeout_s: int = 300) -> None:
        """`core_v1` / `watch_factory` default to the `kubernetes` client's
        (in-cluster config, else kubeconfig); tests pass fakes."""
        self.namespace = namespace
        self.selector = APP_LABEL + (f",{POOL_LABEL}={pool}" if pool else "")
        self.core_v1 = core_v1
        self.watch_factory = watch_factory
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pods: dict[str, Endpoint] = {}
        self._watch: Any = None

    def _client(self) -> None:
        if self.core_v1 is not None:
            return
        from kubernetes import client, config, watch
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.core_v1 = client.CoreV1Api()
        self.watch_factory = watch.Watch

    async def start(self, on_change: OnChange) -> None:
        self._client()
        loop = asyncio.get_running_loop()
        publish = lambda eps: loop.call_soon_threadsafe(on_change, eps)
        self._thread = threading.Thread(target=self._run, args=(publish,),
                                        name="k8s-discovery", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5)

    def _set(self, name: str, ep: Endpoint | None) -> bool:
        old = self._pods.get(name)
        if ep is None:
            self._pods.pop(name, None)
        else:
            self._pods[name] = ep
        return old != ep

    def _run(self, publish: Callable[[list[Endpoint]], None]) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                listing = self.core_v1.list_namespaced_pod(self.namespace,
                                                           label_selector=self.selector)
                self._pods = {}
                for pod in _get(listing, "items") or []:
                    self._set(_get(pod, "metadata", "name"), pod_endpoint(pod, self.namespace))
                publish(list(self._pods.values()))
                version = _get(listing, "metadata", "resource_version")
                self._watch = self.watch_factory()
                for event in self._watch.stream(
                        self.core_v1.list_namespaced_pod, self.namespace,
                        label_selector=self.selector, resource_version=version,
                        timeout_seconds=self.watch_timeout_s):
                    if self._stop.is_set():
                        return
                    pod = event["object"]
                    name = _get(pod, "metadata", "name")
                    ep = None if event["type"] == "DELETED" else pod_endpoint(pod, self.namespace)
                    if self._set(name, ep):
                        publish(list(self._pods.values()))
                backoff = 0.5
            except Exception as err:  # noqa: BLE001 -- API errors, 410 Gone, lost connection
                if self._stop.is_set():
                    return
                log.warning("pod watch failed (%s); re-listing in %.1fs", err, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
