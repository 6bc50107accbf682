"""The chart's operator ClusterRole allows every request the operator actually makes
(recorded by the emulator over a full lifecycle with peering), and nothing on Secrets."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import yaml
from k8s_controllers import controllers
from k8s_harness import cluster, connection, eventually, operator
from test_chart import render
from test_operator_peering import _settings, create_peering

from sluice.operator import kube
from sluice.operator.autoscale import LoadSample

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _allowed(rules: list[dict], verb: str, group: str, resource: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               for r in rules)


def test_operator_cluster_role_covers_every_request_it_makes():
    body = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
    body["spec"]["autoscaling"] = {"enabled": True, "maxReplicas": 2,
                                   "scaleUpStabilizationSeconds": 0}

    async def busy(endpoints, role):
        return LoadSample(0.99, 0.0, 1) if endpoints else None

    async def scenario():
        async with cluster() as (api, server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            client._http.headers["User-Agent"] = "test-client"  # not the operator's requests
            await create_peering(api, client)
            async with operator(server, standalone=False, priority=1, settings=_settings(),
                                sampler=busy, autoscale_interval_s=0.2):
                await client.create(kube.POOLS, "default", body)
                pool = lambda: api.store.get(api.kind("inferencepools"), "default", "smollm2")
                await eventually(lambda: pool()["spec"]["replicas"] == 2, 10, "autoscaled")
                await client.patch(kube.POOLS, "default", "smollm2",
                                   {"spec": {"engine": {"maxNumSeqs": 8}}})
                await eventually(lambda: "8" in api.store.get(
                    api.kind("deployments"), "default", "smollm2-serve")["spec"]["template"][
                    "spec"]["containers"][0]["args"], 5, "updated")
                await client.delete(kube.DEPLOYMENTS, "default", "smollm2-serve")
                await eventually(lambda: api.store.get(api.kind("deployments"), "default",
                                                       "smollm2-serve"), 5, "drift repaired")
                switched = copy.deepcopy({"spec": {"replicas": None, "autoscaling": None,
                                                   "roles": {"prefill": {}, "decode": {}}}})
                await client.patch(kube.POOLS, "default", "smollm2", switched)
                # the roles' deployments and no other (a count of 2 was also met while
                # the new ones were being created, before the old one was deleted)
                await eventually(lambda: sorted(d["metadata"]["name"] for d in api.store.list(
                    api.kind("deployments"), "default")) == ["smollm2-decode",
                                                              "smollm2-prefill"], 5, "pruned")
                await client.delete(kube.POOLS, "default", "smollm2")
                await eventually(lambda: not api.store.list(api.kind("inferencepools"),
                                                            "default"), 5, "deleted")
            await client.close()
        return api.calls

    calls = asyncio.run(asyncio.wait_for(scenario(), 60))
    made = {(verb, group, resource) for agent, verb, group, resource in calls
            if agent.startswith(("kopf/", kube.USER_AGENT))}
    verbs = {v for v, _, _ in made}
    assert {"create", "update", "patch", "delete", "watch", "list", "get"} <= verbs, made
    role = next(m for m in render() if m["kind"] == "ClusterRole"
                and m["metadata"]["name"].endswith("-operator"))
    missing = sorted(c for c in made if not _allowed(role["rules"], *c))
    assert missing == [], f"requests the operator makes that its ClusterRole denies: {missing}"
    assert not any(resource == "secrets" for _, _, resource in made)
