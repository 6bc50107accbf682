"""Two operator replicas with kopf peering (as the chart deploys them for listed
namespaces: the chart's peering CRDs and a KopfPeering in the namespace), on a real API
server: only the one with the higher priority acts; when it goes away the other takes
over."""

from __future__ import annotations

import asyncio
import pathlib

import yaml
from k8s_harness import client, eventually, operator, peering_settings

from sluice.operator import kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
PEERING_CRDS = ROOT / "charts/sluice/crds/kopf-peerings.yaml"



def install_peering_crds(plane) -> None:
    """The chart's kopf peering CRDs, established (idempotent)."""
    plane.kubectl("apply", "--server-side", "-f", str(PEERING_CRDS))
    for crd in yaml.safe_load_all(PEERING_CRDS.read_text()):
        plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                      f"crd/{crd['metadata']['name']}")


async def create_peering(api: kube.KubeClient, namespace: str) -> None:
    """The `sluice` KopfPeering the chart installs in each watched namespace."""
    await api.create(kube.PEERINGS, namespace, {"apiVersion": "kopf.dev/v1",
                                                "kind": "KopfPeering",
                                                "metadata": {"name": "sluice"}})


def test_only_the_highest_priority_replica_acts_and_the_other_takes_over(kube_plane, kube_ns):
    plane, ns = kube_plane, kube_ns
    install_peering_crds(plane)

    async def scenario():
        async with client(plane.admin_kubeconfig) as api:
            await create_peering(api, ns)

            async def priorities() -> list[int]:
                peers = (await api.get(kube.PEERINGS, ns, "sluice")).get("status") or {}
                return sorted(p["priority"] for p in peers.values())

            async def replicas(n: int) -> bool:
                dep = await api.get(kube.DEPLOYMENTS, ns, "smollm2-serve")
                return dep["spec"]["replicas"] == n

            def replica(priority: int):
                return operator(plane, standalone=False, namespaces=(ns,), priority=priority,
                                settings=peering_settings(), autoscale_interval_s=0.2)

            async with replica(10) as low:
                async with replica(20) as high:
                    async def both_announced() -> bool:
                        return await priorities() == [10, 20]
                    await eventually(both_announced, 30, "both replicas in the peering")
                    # alone at first, the low replica acted; from now on it must not
                    low_rounds, high_rounds = low.ticker.rounds, high.ticker.rounds
                    await api.create(kube.POOLS, ns, POOL)
                    await eventually(lambda: replicas(1), 30, "children from the active replica")
                    # the periodic work (outside kopf) follows the same rule
                    await eventually(lambda: high.ticker.rounds >= high_rounds + 3, 30,
                                     "periodic rounds")
                    assert high.reconciler.passes > 0 and low.reconciler.passes == 0
                    assert low.ticker.rounds <= low_rounds + 1  # (one begun before the read)
                    assert await priorities() == [10, 20]
                # the active replica is gone: the other resumes once its peer entry is
                # (removed at exit, or expired after its lifetime)
                await api.patch(kube.POOLS, ns, "smollm2", {"spec": {"replicas": 2}})
                await eventually(lambda: replicas(2), 60, "the standby replica took over")
                assert low.reconciler.passes > 0
                await eventually(lambda: low.ticker.rounds > 0, 30, "the standby's periodic work")

    asyncio.run(asyncio.wait_for(scenario(), 180))
