"""The index finalizer only when there is an index to clean: without Redis a pool carries
no finalizer, so deleting it completes even once the operator is gone (uninstalled). On a
real API server, whose garbage collector (kube-controller-manager) removes the children."""

from __future__ import annotations

import asyncio
import copy
import pathlib
import threading

import yaml
from k8s_harness import View, client, eventually, operator
from k8s_kubelet import kubelet

from sluice.operator import cleanup, kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NAME = "smollm2"


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 90))


async def _finalizers(view: View) -> list[str]:
    return (await view.pool())["metadata"].get("finalizers") or []


async def _handled(view: View) -> bool:
    """kopf has recorded the create handler's success on the pool."""
    annotations = (await view.pool())["metadata"].get("annotations") or {}
    return "sluice.dev/last-handled-configuration" in annotations


async def _gone(view: View) -> bool:
    """The pool deleted and its Deployment collected (its pods with it)."""
    return not await view.names(kube.POOLS) and not await view.names(kube.DEPLOYMENTS)


def test_deletion_without_redis_completes_even_after_the_operator_is_gone(
        kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api, kubelet(api, ns):
            view = View(api, ns)
            async with operator(plane, namespaces=(ns,), index=False,
                                autoscale_interval_s=0.2) as rt:
                await api.create(kube.POOLS, ns, CPU_POOL)
                await eventually(lambda: view.ready(1), 20, "ready")
                # handled, and the periodic work ran (kopf's timers would have put kopf's
                # finalizer on the pool before any handler)
                await eventually(lambda: _handled(view), 10, "handled")
                await eventually(lambda: rt.ticker.rounds >= 2, 10, "two ticks")
                assert not await _finalizers(view)
            # the operator uninstalled: the pool still goes, children with it
            assert await view.names(kube.DEPLOYMENTS) == ["smollm2-serve"]
            await api.delete(kube.POOLS, ns, NAME)
            await eventually(lambda: _gone(view), 30, "pool deleted, children collected")
    run(scenario)


def test_a_finalizer_left_by_an_earlier_configuration_is_removed(kube_controllers, kube_ns):
    """A pool from when the operator had a Redis URL: the operator without one releases it."""
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api:
            view = View(api, ns)
            body = copy.deepcopy(CPU_POOL)
            body["metadata"]["finalizers"] = [cleanup.FINALIZER]
            await api.create(kube.POOLS, ns, body)
            assert await _finalizers(view) == [cleanup.FINALIZER]
            async with operator(plane, namespaces=(ns,), index=False):
                await eventually(lambda: view.get(kube.DEPLOYMENTS, "smollm2-serve"), 20,
                                 "children")
                await eventually(lambda: _no_finalizers(view), 20, "finalizer removed")
                await api.delete(kube.POOLS, ns, NAME)
                await eventually(lambda: _gone(view), 30, "deleted, children collected")
    run(scenario)


async def _no_finalizers(view: View) -> bool:
    return not await _finalizers(view)


def test_with_an_index_the_finalizer_holds_the_pool_until_the_purge(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns
    calls: list[tuple[str, str]] = []
    release = threading.Event()  # the purge runs on the operator's thread

    async def purge(namespace: str, pool: str, pods: list[str]) -> int:
        calls.append((namespace, pool))
        await asyncio.to_thread(release.wait, 60)
        return 0

    async def scenario():
        async with client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,),
                                                                   purge=purge):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)

            async def finalized() -> bool:
                return await _finalizers(view) == [cleanup.FINALIZER]
            await eventually(finalized, 20, "finalizer")
            await api.delete(kube.POOLS, ns, NAME)
            await eventually(lambda: calls, 20, "the purge started")
            # held while the purge runs
            assert (await view.pool())["metadata"]["deletionTimestamp"]
            release.set()
            await eventually(lambda: _gone(view), 30, "deleted after the purge")
            assert calls == [(ns, NAME)]
    try:
        run(scenario)
    finally:
        release.set()
