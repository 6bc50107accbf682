"""The index finalizer only when there is an index to clean: without Redis a pool carries
no finalizer, so deleting it completes even once the operator is gone (uninstalled)."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import yaml
from k8s_controllers import controllers
from k8s_harness import cluster, connection, eventually, operator

from sluice.operator import cleanup, kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NS, NAME = "default", "smollm2"


def _pool(api):
    return api.store.get(api.kind("inferencepools"), NS, NAME)


def _gone(api):
    return not api.store.list(api.kind("inferencepools"), NS) and not api.store.list(
        api.kind("deployments"), NS)


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_deletion_without_redis_completes_even_after_the_operator_is_gone():
    async def scenario():
        async with cluster() as (api, server):
            client = kube.KubeClient.from_connection(connection(server))
            async with operator(server, index=False, autoscale_interval_s=0.2) as rt, \
                    controllers(api):
                await client.create(kube.POOLS, NS, CPU_POOL)
                await eventually(lambda: (_pool(api).get("status") or {}).get(
                    "readyReplicas") == 1, 5, "ready")
                # handled, and the periodic work ran (kopf's timers would have put kopf's
                # finalizer on the pool before any handler)
                await eventually(lambda: "sluice.dev/last-handled-configuration" in _pool(
                    api)["metadata"]["annotations"] and rt.ticker.rounds >= 2, 3, "handled")
                assert not _pool(api)["metadata"].get("finalizers")
            # the operator uninstalled: the pool still goes, children with it
            await client.delete(kube.POOLS, NS, NAME)
            await eventually(lambda: _gone(api), 10, "pool deleted, children collected")
            await client.close()
    run(scenario)


def test_a_finalizer_left_by_an_earlier_configuration_is_removed():
    """A pool from when the operator had a Redis URL: the operator without one releases it."""
    async def scenario():
        async with cluster() as (api, server):
            client = kube.KubeClient.from_connection(connection(server))
            body = copy.deepcopy(CPU_POOL)
            body["metadata"]["finalizers"] = [cleanup.FINALIZER]
            await client.create(kube.POOLS, NS, body)
            async with operator(server, index=False):
                await eventually(lambda: not _pool(api)["metadata"].get("finalizers"), 5,
                                 "finalizer removed")
                await client.delete(kube.POOLS, NS, NAME)
                await eventually(lambda: _gone(api), 10, "deleted")
            await client.close()
    run(scenario)


def test_with_an_index_the_finalizer_holds_the_pool_until_the_purge():
    async def scenario():
        calls = []

        async def purge(namespace, pool, pods):
            calls.append((namespace, pool))
            return 0

        async with cluster() as (api, server), operator(server, purge=purge):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await eventually(lambda: _pool(api)["metadata"].get("finalizers") == [
                cleanup.FINALIZER], 3, "finalizer")
            await client.delete(kube.POOLS, NS, NAME)
            await eventually(lambda: _gone(api), 5, "deleted after the purge")
            assert calls == [(NS, NAME)]
            await client.close()
    run(scenario)
