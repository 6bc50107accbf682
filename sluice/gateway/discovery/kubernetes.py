"""Kubernetes discovery: ready engine pods of InferencePools, via list + watch.

Selects pods labelled `app.kubernetes.io/name=sluice-engine` (and `sluice.dev/pool=<pool>`
when a pool is given) in the namespaces the operator serves: the same list (the chart's
`watchNamespaces` feeds both), or every namespace (`*`). Labels, annotation and ports are
`sluice.labels`, the operator's own contract. A pod counts when it has an IP, is not being
deleted and its Ready condition is True. The model is the `sluice.dev/model` annotation;
ports are the container ports named `http` / `kv-events` / `kv-replay` (defaults 8000 /
5557 / 5558). The role (prefill/decode pools) is the `sluice.dev/role` label, else llm-d's
`llm-d.ai/role` (`static.parse_role`). Each namespace is watched on a thread of its own (the `kubernetes` client is
synchronous; a namespaced Role allows no cluster-wide watch) that re-lists after any error
or expiry, with a capped backoff.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sluice import labels
from sluice.gateway.discovery.static import Endpoint, OnChange, parse_role

log = logging.getLogger("sluice.gateway.k8s")

ALL_NAMESPACES = "*"
DEFAULT_PORTS = dict(labels.PORTS)


def parse_namespaces(values: Iterable[str]) -> tuple[str, ...]:
    """`--namespace` values (repeatable, each maybe a comma list) → namespaces, in order,
    without repeats; `*` alone means every namespace."""
    out: list[str] = []
    for value in values:
        out += [n.strip() for n in value.split(",") if n.strip() and n.strip() not in out]
    if ALL_NAMESPACES in out and len(out) > 1:
        raise ValueError("namespace '*' (every namespace) cannot be combined with others")
    return tuple(out)


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
    pod_labels = _get(pod, "metadata", "labels") or {}
    annotations = _get(pod, "metadata", "annotations") or {}
    host = f"[{ip}]" if ":" in ip else ip
    return Endpoint(pod=f"{host}:{ports['http']}", url=f"http://{host}:{ports['http']}",
                    model=annotations.get(labels.MODEL_ANNOTATION),
                    pool=pod_labels.get(labels.POOL, ""),
                    namespace=_get(pod, "metadata", "namespace") or namespace,
                    events=f"tcp://{host}:{ports['kv-events']}",
                    replay=f"tcp://{host}:{ports['kv-replay']}",
                    events_curve=_flag(annotations.get(labels.KV_EVENTS_CURVE_ANNOTATION)),
                    role=parse_role(pod_labels.get(labels.ROLE)
                                    or pod_labels.get(labels.LLMD_ROLE)))


def _flag(value: str | None) -> bool | None:
    return {"true": True, "false": False}.get((value or "").lower())


class KubernetesDiscovery:
    """The watch threads own nothing but their namespace's entries in `_pods`, which
    `_lock` guards; `publish` hands a copy of all of them to the event loop."""

    def __init__(self, namespaces: str | Sequence[str], pool: str | None = None,
                 core_v1: Any = None, watch_factory: Callable[[], Any] | None = None,
                 watch_timeout_s: int = 300) -> None:
        """`namespaces`: one, several, or `*` (every namespace). `core_v1` /
        `watch_factory` default to the `kubernetes` client's (in-cluster config, else
        kubeconfig); tests pass fakes."""
        names = parse_namespaces([namespaces] if isinstance(namespaces, str) else namespaces)
        self.namespaces: tuple[str, ...] = names or (ALL_NAMESPACES,)
        self.selector = labels.engine_selector(pool)
        self.core_v1 = core_v1
        self.watch_factory = watch_factory
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], Endpoint] = {}  # (namespace, pod name) ->
        self._watches: list[Any] = []

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
        for namespace in self.namespaces:
            thread = threading.Thread(target=self._run, args=(namespace, publish),
                                      name=f"k8s-discovery-{namespace}", daemon=True)
            self._threads.append(thread)
            thread.start()

    async def stop(self) -> None:
        self._stop.set()
        for watch in list(self._watches):
            watch.stop()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 5)

    def _list_fn(self, namespace: str) -> tuple[Callable[..., Any], tuple[str, ...]]:
        if namespace == ALL_NAMESPACES:
            return self.core_v1.list_pod_for_all_namespaces, ()
        return self.core_v1.list_namespaced_pod, (namespace,)

    def _replace(self, namespace: str, pods: dict[tuple[str, str], Endpoint]) -> list[Endpoint]:
        with self._lock:
            self._pods = {k: v for k, v in self._pods.items()
                          if namespace != ALL_NAMESPACES and k[0] != namespace}
            self._pods.update(pods)
            return list(self._pods.values())

    def _set(self, key: tuple[str, str], ep: Endpoint | None) -> list[Endpoint] | None:
        """All endpoints when `key`'s changed, else None."""
        with self._lock:
            old = self._pods.get(key)
            if ep is None:
                self._pods.pop(key, None)
            else:
                self._pods[key] = ep
            return list(self._pods.values()) if old != ep else None

    def _run(self, namespace: str, publish: Callable[[list[Endpoint]], None]) -> None:
        list_fn, args = self._list_fn(namespace)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                listing = list_fn(*args, label_selector=self.selector)
                found = {}
                for pod in _get(listing, "items") or []:
                    key = (_get(pod, "metadata", "namespace") or namespace,
                           _get(pod, "metadata", "name"))
                    ep = pod_endpoint(pod, key[0])
                    if ep is not None:
                        found[key] = ep
                publish(self._replace(namespace, found))
                version = _get(listing, "metadata", "resource_version")
                watch = self.watch_factory()
                self._watches.append(watch)
                try:
                    for event in watch.stream(list_fn, *args, label_selector=self.selector,
                                              resource_version=version,
                                              timeout_seconds=self.watch_timeout_s):
                        if self._stop.is_set():
                            return
                        pod = event["object"]
                        key = (_get(pod, "metadata", "namespace") or namespace,
                               _get(pod, "metadata", "name"))
                        ep = None if event["type"] == "DELETED" else pod_endpoint(pod, key[0])
                        changed = self._set(key, ep)
                        if changed is not None:
                            publish(changed)
                finally:
                    self._watches.remove(watch)
                backoff = 0.5
            except Exception as err:  # noqa: BLE001 -- API errors, 410 Gone, lost connection
                if self._stop.is_set():
                    return
                log.warning("pod watch in %s failed (%s); re-listing in %.1fs", namespace, err,
                            backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
