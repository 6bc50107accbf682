"""Kubernetes discovery: ready engine pods of InferencePools, via list + watch.

Selects pods labelled `app.kubernetes.io/name=sluice-engine` (and `sluice.dev/pool=<pool>`
when a pool is given) in the namespaces the operator serves: the same list (the chart's
`watchNamespaces` feeds both), or every namespace (`*`). Labels, annotation and ports are
`sluice.labels`, the operator's own contract. A pod counts when it has an IP, is not being
deleted and its Ready condition is True. The model is the `sluice.dev/model` annotation;
ports are the container ports named `http` / `kv-events` / `kv-replay` (defaults 8000 /
5557 / 5558). The role (prefill/decode pools) is the `sluice.dev/role` label, else llm-d's
`llm-d.ai/role` (`static.parse_role`).

The client is kubernetes_asyncio (the operator's too), logged in by
`sluice.kube_config.load`. Each namespace is watched by a task of its own (a namespaced
Role allows no cluster-wide watch) that re-lists after any error or expiry, with a capped
backoff. Pods are read as the API server's JSON: no model objects are built per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch as k8s_watch

from sluice import kube_config, labels
from sluice.gateway.discovery.pool_scope import (
    PoolRef,
    PoolSelector,
    PoolUnusable,
    read_selector,
)
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


def pod_endpoint(pod: dict[str, Any], namespace: str,
                 http_port: int | None = None) -> Endpoint | None:
    """The pod's Endpoint when it is ready to serve, else None (`pod`: the API's JSON;
    `http_port`: a GIE pool's target port, over the pod's `http` container port)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    ip = status.get("podIP")
    if not ip or not any(c.get("type") == "Ready" and c.get("status") == "True"
                         for c in status.get("conditions") or ()):
        return None
    ports = dict(DEFAULT_PORTS)
    for container in (pod.get("spec") or {}).get("containers") or ():
        for p in container.get("ports") or ():
            if p.get("name") in ports:
                ports[p["name"]] = int(p["containerPort"])
    if http_port is not None:
        ports["http"] = http_port
    pod_labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    host = f"[{ip}]" if ":" in ip else ip
    return Endpoint(pod=f"{host}:{ports['http']}", url=f"http://{host}:{ports['http']}",
                    model=annotations.get(labels.MODEL_ANNOTATION),
                    pool=pod_labels.get(labels.POOL, ""),
                    namespace=meta.get("namespace") or namespace,
                    events=f"tcp://{host}:{ports['kv-events']}",
                    replay=f"tcp://{host}:{ports['kv-replay']}",
                    events_curve=_flag(annotations.get(labels.KV_EVENTS_CURVE_ANNOTATION)),
                    role=parse_role(pod_labels.get(labels.ROLE)
                                    or pod_labels.get(labels.LLMD_ROLE)))


def _flag(value: str | None) -> bool | None:
    return {"true": True, "false": False}.get((value or "").lower())


def _key(pod: dict[str, Any], namespace: str) -> tuple[str, str]:
    """(namespace, name): the pod's own namespace, `namespace` when it carries none."""
    return pod["metadata"].get("namespace") or namespace, pod["metadata"]["name"]


class KubernetesDiscovery:
    """One watch task per namespace; each owns its namespace's entries in `_pods` (all of
    them for `*`), and every change hands a copy of all entries to `on_change`."""

    def __init__(self, namespaces: str | Sequence[str], pool: str | None = None,
                 configuration: k8s.Configuration | None = None,
                 watch_timeout_s: int = 300, pool_ref: PoolRef | None = None,
                 refresh_s: float = 10.0) -> None:
        """`namespaces`: one, several, or `*` (every namespace). `configuration`: the
        cluster and identity; default `kube_config.load()` (in-cluster, else kubeconfig).
        `pool_ref`: serve that one InferencePool (pool_scope.py): its namespace, its
        selector, read again every `refresh_s`; `namespaces` and `pool` are then unused."""
        names = parse_namespaces([namespaces] if isinstance(namespaces, str) else namespaces)
        self.namespaces: tuple[str, ...] = names or (ALL_NAMESPACES,)
        self.selector = labels.engine_selector(pool)
        self.http_port: int | None = None
        self.pool_ref, self.refresh_s = pool_ref, refresh_s
        if pool_ref is not None:
            self.namespaces = (pool_ref.namespace,)
        self.configuration = configuration
        self.watch_timeout_s = watch_timeout_s
        self._api: k8s.ApiClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pods: dict[tuple[str, str], Endpoint] = {}  # (namespace, pod name) ->
        self.lists = 0  # full listings made (the first, then one after each error/expiry)

    async def start(self, on_change: OnChange) -> None:
        if self.configuration is None:
            self.configuration = await kube_config.load()
        self._api = k8s.ApiClient(self.configuration)
        core = k8s.CoreV1Api(self._api)
        if self.pool_ref is not None:
            self._tasks.append(asyncio.create_task(self._follow_pool(core, on_change),
                                                   name=f"k8s-pool-{self.pool_ref.name}"))
            return
        for namespace in self.namespaces:
            self._tasks.append(asyncio.create_task(self._run(core, namespace, on_change),
                                                   name=f"k8s-discovery-{namespace}"))

    async def _follow_pool(self, core: k8s.CoreV1Api, on_change: OnChange) -> None:
        """The pod watch of the pool's current selector, replaced when the selector changes
        (its first listing replaces the endpoints); none while the pool is not usable."""
        ref, current, watch = self.pool_ref, "", None  # "": nothing read yet
        assert ref is not None and self._api is not None
        try:
            while True:
                try:
                    found: PoolSelector | str = await read_selector(self._api, ref)
                except PoolUnusable as err:
                    if not err.gone:  # a failed read: the pods watched so far still are
                        log.warning("InferencePool %s/%s (%s) not read: %s", ref.namespace,
                                    ref.name, ref.group, err)
                        await asyncio.sleep(self.refresh_s)
                        continue
                    found = str(err)
                if found != current:
                    await _cancel(watch)
                    watch, current = None, found
                    if isinstance(found, str):
                        log.warning("InferencePool %s/%s (%s) gone, no endpoints: %s",
                                    ref.namespace, ref.name, ref.group, found)
                        on_change(self._replace(ref.namespace, {}))
                    else:
                        self.selector, self.http_port = found.labels, found.port
                        log.info("InferencePool %s/%s selects %s (port %s)", ref.namespace,
                                 ref.name, found.labels, found.port or "http")
                        watch = asyncio.create_task(self._run(core, ref.namespace, on_change))
                await asyncio.sleep(self.refresh_s)
        finally:
            await _cancel(watch)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._api is not None:
            await self._api.close()

    def _replace(self, namespace: str, pods: dict[tuple[str, str], Endpoint]) -> list[Endpoint]:
        self._pods = {k: v for k, v in self._pods.items()
                      if namespace != ALL_NAMESPACES and k[0] != namespace}
        self._pods.update(pods)
        return list(self._pods.values())

    def _set(self, key: tuple[str, str], ep: Endpoint | None) -> list[Endpoint] | None:
        """All endpoints when `key`'s changed, else None."""
        old = self._pods.get(key)
        if ep is None:
            self._pods.pop(key, None)
        else:
            self._pods[key] = ep
        return list(self._pods.values()) if old != ep else None

    async def _run(self, core: k8s.CoreV1Api, namespace: str, on_change: OnChange) -> None:
        list_fn, args = ((core.list_pod_for_all_namespaces, ()) if namespace == ALL_NAMESPACES
                         else (core.list_namespaced_pod, (namespace,)))
        backoff = 0.5
        while True:
            try:
                response = await list_fn(*args, label_selector=self.selector,
                                         _preload_content=False)
                listing = await response.json()
                self.lists += 1
                found = {}
                for pod in listing.get("items") or ():
                    key = _key(pod, namespace)
                    if (ep := pod_endpoint(pod, key[0], self.http_port)) is not None:
                        found[key] = ep
                on_change(self._replace(namespace, found))
                version = listing["metadata"]["resourceVersion"]
                async with k8s_watch.Watch(return_type="object") as watch:
                    async for event in watch.stream(
                            list_fn, *args, label_selector=self.selector,
                            resource_version=version, timeout_seconds=self.watch_timeout_s):
                        pod = event["raw_object"]
                        key = _key(pod, namespace)
                        ep = (None if event["type"] == "DELETED"
                              else pod_endpoint(pod, key[0], self.http_port))
                        if (changed := self._set(key, ep)) is not None:
                            on_change(changed)
                backoff = 0.5  # the watch expired: list again, at once
            except Exception as err:  # noqa: BLE001 -- API errors, 410 Gone, lost connection
                log.warning("pod watch in %s failed (%s); re-listing in %.1fs", namespace,
                            err, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
