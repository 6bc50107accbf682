"""kopf wiring: thin handlers that hand work to the Reconciler, Autoscaler and purger.

Triggers of a reconcile pass: the pool is created, updated or resumed (operator
restart), one of its children or pods changes (drift: edited or deleted by hand,
Deployment became ready), and a resync timer as a safety net. Deletion runs the
index finalizer; ownerReferences let the garbage collector remove the children.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from sluice.operator import cleanup, crd, kube, labels
from sluice.operator.autoscaler import Autoscaler
from sluice.operator.config import OperatorConfig
from sluice.operator.reconciler import Reconciler

log = logging.getLogger("sluice.operator")
POOL = (crd.GROUP, crd.VERSION, crd.PLURAL)
CHILDREN = (("apps", "v1", "deployments"), ("", "v1", "services"),
            ("policy", "v1", "poddisruptionbudgets"), ("", "v1", "pods"))
MANAGED = {labels.MANAGED_BY: labels.OPERATOR_NAME}
PURGE_ATTEMPTS = 5


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """EventSink posting through kopf's event queue (batched, non-blocking)."""
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


@dataclass
class Runtime:
    config: OperatorConfig
    connection: kopf.ConnectionInfo
    client: kube.KubeClient
    reconciler: Reconciler
    autoscaler: Autoscaler
    purge: cleanup.IndexPurger
    stats: dict[str, float] = field(default_factory=dict)  # counters for benchmarks


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    settings.persistence.finalizer = labels.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events only, not handler chatter
    settings.peering.name = config.peering_name
    settings.peering.standalone = config.standalone
    settings.peering.clusterwide = config.clusterwide
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
    def _login(**_: Any) -> kopf.ConnectionInfo:
        return rt.connection

    @kopf.on.resume(*POOL, registry=registry)
    @kopf.on.create(*POOL, registry=registry)
    @kopf.on.update(*POOL, registry=registry)
    async def _pool_changed(body: kopf.Body, **_: Any) -> None:
        try:
            await rt.reconciler.reconcile(dict(body))
        except kube.ApiError as e:
            raise kopf.TemporaryError(f"API error while reconciling: {e}", delay=5) from e

    resync = rt.config.resync_interval_s

    @kopf.timer(*POOL, interval=resync, registry=registry,
                initial_delay=lambda **_: resync * random.uniform(0.5, 1.5))  # spread out
    async def _resync(body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
        if rt.reconciler.idle_for(namespace, name) >= 0.9 * resync:
            await rt.reconciler.reconcile(dict(body), full=True)

    @kopf.timer(*POOL, interval=rt.config.autoscale_interval_s, registry=registry)
    async def _autoscale(body: kopf.Body, **_: Any) -> None:
        await rt.autoscaler.tick(dict(body))

    async def _child_changed(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        pool = labels.get("sluice.dev/pool")
        if pool and namespace:
            await rt.reconciler.reconcile_named(namespace, pool)

    for group, version, plural in CHILDREN:
        resource = (group, version, plural) if group else (version, plural)
        kopf.on.event(*resource, labels=MANAGED, registry=registry,
                      id=f"child-{plural}")(_child_changed)

    @kopf.on.delete(*POOL, backoff=5, registry=registry)
    async def _pool_deleted(body: kopf.Body, namespace: str, name: str, retry: int,
                            **_: Any) -> None:
        endpoints = list((body.get("status") or {}).get("endpoints") or [])
        pods = await rt.client.list(kube.PODS, namespace, labels.pool_selector(name))
        ids = cleanup.pool_pod_ids(endpoints, pods)
        try:
            purged = await rt.purge(namespace, name, ids)
        except Exception as e:  # Redis down: retry a while, never block the deletion forever
            if retry < PURGE_ATTEMPTS - 1:
                raise kopf.TemporaryError(f"index cleanup failed: {type(e).__name__}",
                                          delay=5) from e
            post_event(dict(body), "Warning", "IndexPurgeFailed",
                       f"gave up removing {len(ids)} engines from the index after "
                       f"{PURGE_ATTEMPTS} attempts ({type(e).__name__}); gateways drop "
                       "them when their load entries expire")
            return
        post_event(dict(body), "Normal", "IndexPurged",
                   f"removed {len(ids)} engines ({purged} prefix-index keys) from the index")

    return registry
