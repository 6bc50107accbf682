"""Two operator replicas with kopf peering (as the chart deploys them): only the one
with the higher priority acts; when it goes away the other takes over."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib

import kopf
import yaml
from k8s_controllers import controllers
from k8s_harness import cluster, connection, eventually, operator

from sluice.operator import kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
PEERINGS = kube.ResourceRef("kopf.dev", "v1", "clusterkopfpeerings", namespaced=False)


def _settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # seconds a silent peer still counts as alive; kopf refreshes its entry about
    # every lifetime - 5..10 s (at least 1 s), so a short lifetime would let one
    # slow second on a loaded machine make the standby think the active one died
    settings.peering.lifetime = 10
    settings.queueing.idle_timeout = 0.5
    settings.queueing.exit_timeout = 0.5
    settings.background.instant_exit_timeout = 0.05
    return settings


async def create_peering(api, client: kube.KubeClient) -> None:
    """Register the chart's ClusterKopfPeering CRD and create the `sluice` peering."""
    for crd in yaml.safe_load_all((ROOT / "charts/sluice/crds/kopf-peerings.yaml").read_text()):
        api.register_crd(crd)
    await client.create(PEERINGS, None, {"apiVersion": "kopf.dev/v1",
                                         "kind": "ClusterKopfPeering",
                                         "metadata": {"name": "sluice"}})


def test_only_the_highest_priority_replica_acts_and_the_other_takes_over():
    async def scenario():
        async with cluster() as (api, server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            await create_peering(api, client)
            async with contextlib.AsyncExitStack() as low_stack:
                low = await low_stack.enter_async_context(operator(
                    server, standalone=False, priority=10, settings=_settings(),
                    autoscale_interval_s=0.2))
                async with operator(server, standalone=False, priority=20,
                                    settings=_settings(), autoscale_interval_s=0.2) as high:
                    async def both_announced():
                        peers = (await client.get(PEERINGS, None, "sluice")).get("status")
                        return sorted(p["priority"] for p in (peers or {}).values()) == [10, 20]

                    for _ in range(100):
                        if await both_announced():
                            break
                        await asyncio.sleep(0.1)
                    assert await both_announced()
                    # alone at first, the low replica acted; from now on it must not
                    low_rounds, high_rounds = low.ticker.rounds, high.ticker.rounds
                    await client.create(kube.POOLS, "default", POOL)
                    deployment = lambda: api.store.get(api.kind("deployments"), "default",
                                                       "smollm2-serve")
                    await eventually(deployment, 5, "children from the active replica")
                    # the periodic work (outside kopf) follows the same rule
                    await eventually(lambda: high.ticker.rounds >= high_rounds + 3, 5,
                                     "periodic rounds")
                    assert high.reconciler.passes > 0 and low.reconciler.passes == 0
                    assert low.ticker.rounds <= low_rounds + 1  # (one begun before the read)
                    peers = (await client.get(PEERINGS, None, "sluice")).get("status") or {}
                    assert sorted(p["priority"] for p in peers.values()) == [10, 20]
                # the active replica is gone: the other resumes once its peer entry expires
                await client.patch(kube.POOLS, "default", "smollm2", {"spec": {"replicas": 2}})
                await eventually(lambda: deployment()["spec"]["replicas"] == 2, 30,
                                 "the standby replica took over")
                assert low.reconciler.passes > 0
                await eventually(lambda: low.ticker.rounds > 0, 5, "the standby's periodic work")
            await client.close()
    asyncio.run(asyncio.wait_for(scenario(), 60))
