"""kopf wiring: thin handlers that hand work to the Reconciler, the Retrier and the purger.

Triggers of a reconcile pass: the pool is created, updated or resumed (operator
restart), and one of its children or pods changes (drift: edited or deleted by hand,
Deployment became ready). A failed pool handler is retried by kopf with the same backoff
(`TemporaryError`); a failed child-event pass by the `Retrier` (kopf does not retry
event handlers). Autoscaling and the resync are the `Ticker`'s, outside kopf: kopf's
timers would put a finalizer on every pool.

kopf's finalizer is on a pool only while a deletion handler needs it: the index cleanup,
registered only when there is an index to clean (`Runtime.purge`). Without one, pools
carry no finalizer, and kopf removes the one an earlier configuration left, so deleting
a pool never waits for the operator. ownerReferences let the garbage collector remove
the children either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf
from kubernetes_asyncio import client as k8s

from sluice import labels
from sluice.operator import cleanup, crd, credentials, kube
from sluice.operator.autoscaler import Autoscaler
from sluice.operator.config import OperatorConfig
from sluice.operator.reconciler import EventSink, Reconciler
from sluice.operator.retry import Retrier
from sluice.operator.ticker import Ticker

log = logging.getLogger("sluice.operator")
POOL = (crd.GROUP, crd.VERSION, crd.PLURAL)
CHILDREN = (("apps", "v1", "deployments"), ("", "v1", "services"),
            ("policy", "v1", "poddisruptionbudgets"), ("", "v1", "pods"))
MANAGED = {labels.MANAGED_BY: labels.OPERATOR_NAME}
PURGE_ATTEMPTS = 5


@dataclass
class Runtime:
    config: OperatorConfig
    configuration: k8s.Configuration  # the operator's identity, shared with kopf
    client: kube.KubeClient
    events: EventSink
    reconciler: Reconciler
    autoscaler: Autoscaler
    purge: cleanup.IndexPurger | None  # None: no index to clean, so no finalizer
    retrier: Retrier
    ticker: Ticker
    stats: dict[str, float] = field(default_factory=dict)  # counters for benchmarks
    http: httpx.AsyncClient | None = None  # to the engines (closed with the operator)


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    # Also the name kopf removes from pools when no deletion handler needs it any more.
    settings.persistence.finalizer = cleanup.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events only, not handler chatter
    settings.peering.name = config.peering_name
    settings.peering.standalone = config.standalone
    settings.peering.clusterwide = config.clusterwide
    # Watching given namespaces needs no cluster-wide list/watch of CRDs and namespaces
    # (the chart's Roles grant none): serve what exists at start, like a namespaced kopf.
    settings.scanning.disabled = not config.clusterwide
    # Watch only our own children and engine pods, filtered by the API server (kopf's
    # handler label filters alone would stream every pod of the cluster to the operator).
    for group, version, plural in CHILDREN:
        key = (f"{group}/{version}" if group else version, plural)
        settings.watching.label_selectors[key] = labels.pool_selector_all()
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30


def register(registry: kopf.OperatorRegistry, rt: Runtime) -> kopf.OperatorRegistry:
    @kopf.on.login(registry=registry)
    async def _login(**_: Any) -> kopf.ConnectionInfo:
        return await credentials.kopf_connection(rt.configuration)  # a rotated token too

    # Explicit ids: kopf names its progress annotations after them (`sluice.dev/<id>`),
    # and a function's own name (`_pool_changed`, `f.<locals>.g`) is no valid annotation key.
    @kopf.on.resume(*POOL, id="pool", registry=registry)
    @kopf.on.create(*POOL, id="pool", registry=registry)
    @kopf.on.update(*POOL, id="pool", registry=registry)
    async def _pool_changed(body: kopf.Body, retry: int, **_: Any) -> None:
        try:
            await rt.reconciler.reconcile(dict(body))
        except (kube.ApiError, *kube.TRANSPORT_ERRORS) as e:
            raise kopf.TemporaryError(f"API error while reconciling: {e}",
                                      delay=rt.retrier.backoff.delay(retry)) from e

    async def _child_changed(namespace: str | None, **kwargs: Any) -> None:
        pool = kwargs["labels"].get(labels.POOL)  # (kopf's `labels` kwarg: the child's)
        if pool and namespace:
            await rt.retrier.run((namespace, pool),
                                 lambda: rt.reconciler.reconcile_named(namespace, pool))

    for group, version, plural in CHILDREN:
        resource = (group, version, plural) if group else (version, plural)
        kopf.on.event(*resource, labels=MANAGED, registry=registry,
                      id=f"child-{plural}")(_child_changed)

    if rt.purge is not None:
        _register_index_cleanup(registry, rt, rt.purge)
    return registry


def _register_index_cleanup(registry: kopf.OperatorRegistry, rt: Runtime,
                            purge: cleanup.IndexPurger) -> None:
    @kopf.on.delete(*POOL, id="index-cleanup", backoff=5, registry=registry)
    async def _pool_deleted(body: kopf.Body, namespace: str, name: str, retry: int,
                            **_: Any) -> None:
        endpoints = list((body.get("status") or {}).get("endpoints") or [])
        pods = await rt.client.list(kube.PODS, namespace, labels.pool_selector(name))
        ids = cleanup.pool_pod_ids(endpoints, pods)
        try:
            purged = await purge(namespace, name, ids)
        except Exception as e:  # Redis down: retry a while, never block the deletion forever
            if retry < PURGE_ATTEMPTS - 1:
                raise kopf.TemporaryError(f"index cleanup failed: {type(e).__name__}",
                                          delay=5) from e
            rt.events(dict(body), "Warning", "IndexPurgeFailed",
                      f"gave up removing {len(ids)} engines from the index after "
                      f"{PURGE_ATTEMPTS} attempts ({type(e).__name__}); gateways drop "
                      "them when their load entries expire")
            return
        rt.events(dict(body), "Normal", "IndexPurged",
                  f"removed {len(ids)} engines ({purged} prefix-index keys) from the index")
