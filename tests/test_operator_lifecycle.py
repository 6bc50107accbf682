"""The operator (kopf + reconciler) against the emulated API server: create, update,
scale, drift, delete, restart. Each scenario runs the real operator in-process."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import yaml
from k8s_controllers import controllers, settle
from k8s_harness import FakePurger, cluster, connection, eventually, operator

from sluice.operator import kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NS, NAME = "default", "smollm2"


def _get(api, plural, name, ns=NS):
    return api.store.get(api.kind(plural), ns, name)


def _pool(api):
    return _get(api, "inferencepools", NAME)


def _condition(api, type_):
    for c in (_pool(api).get("status") or {}).get("conditions", ()):
        if c["type"] == type_:
            return c
    return None


def _events(api):
    return [(e.obj["reason"], e.obj.get("message", "")) for e in api.store.log
            if e.kind.plural == "events" and e.type == "ADDED"]


def _ready(api, n):
    status = _pool(api).get("status") or {}
    return (status.get("readyReplicas") == n
            and status.get("observedGeneration") == _pool(api)["metadata"]["generation"]
            and (_condition(api, "Ready") or {}).get("status") == "True")


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_create_renders_children_and_status_within_a_second():
    async def scenario():
        async with cluster() as (api, server), operator(server):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            # how fast is measured by `python -m sluice.operator.bench`, not here
            await eventually(lambda: _pool(api).get("status", {}).get("conditions"), 10,
                             "children and a status")
            dep = _get(api, "deployments", "smollm2-serve")
            assert _get(api, "services", "smollm2")["spec"]["clusterIP"] == "None"
            assert _get(api, "poddisruptionbudgets", "smollm2-serve")
            assert dep["metadata"]["ownerReferences"][0]["uid"] == _pool(api)["metadata"]["uid"]
            assert _condition(api, "Ready")["status"] == "False"  # no pods yet
            await settle(api)
            await eventually(lambda: _ready(api, 1), 3, "Ready after the pods come up")
            status = _pool(api)["status"]
            assert status["endpoints"][0]["url"].endswith(":8000")
            assert status["selector"] == "sluice.dev/pool=smollm2,sluice.dev/role=serve"
            assert "sluice.dev/index-cleanup" in _pool(api)["metadata"]["finalizers"]
            await eventually(lambda: ("Created", "created Deployment/smollm2-serve")
                             in _events(api), 3, "a Created event")
            await client.close()
            # children and pods are filtered by the API server, not streamed cluster-wide
            child_watches = [(p, sel) for p, sel in api.watches if p in (
                "pods", "deployments", "services", "poddisruptionbudgets")]
            assert len(child_watches) >= 4
            assert all(sel == "app.kubernetes.io/managed-by=sluice-operator,sluice.dev/pool"
                       for _, sel in child_watches), child_watches
    run(scenario)


def test_spec_change_updates_children_and_scale_subresource_resizes():
    async def scenario():
        async with cluster() as (api, server), operator(server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await eventually(lambda: _ready(api, 1), 3, "ready")
            await client.patch(kube.POOLS, NS, NAME, {"spec": {"engine": {"maxNumSeqs": 7}}})
            def args():
                c = _get(api, "deployments", "smollm2-serve")["spec"]["template"]["spec"][
                    "containers"][0]
                return c["args"][c["args"].index("--max-num-seqs") + 1] == "7"
            await eventually(args, 3, "Deployment args updated")
            await eventually(lambda: _pool(api)["status"]["observedGeneration"] == 2, 3,
                             "observedGeneration follows the spec")
            # kubectl scale / HPA path
            await client.patch(kube.POOLS, NS, NAME, {"spec": {"replicas": 3}},
                               subresource="scale")
            await eventually(lambda: _get(api, "deployments", "smollm2-serve")["spec"][
                "replicas"] == 3, 3, "Deployment resized")
            await eventually(lambda: _ready(api, 3), 3, "3 ready")
            scale = await client.get(kube.POOLS, NS, NAME, subresource="scale")
            assert scale["status"] == {"replicas": 3, "selector":
                                       "sluice.dev/pool=smollm2,sluice.dev/role=serve"}
            assert len(_pool(api)["status"]["endpoints"]) == 3
            await client.close()
    run(scenario)


def test_drift_is_repaired_within_five_seconds():
    async def scenario():
        async with cluster() as (api, server), operator(server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await eventually(lambda: _ready(api, 1), 3, "ready")
            uid = _get(api, "deployments", "smollm2-serve")["metadata"]["uid"]
            # hand edit
            live = await client.get(kube.DEPLOYMENTS, NS, "smollm2-serve")
            edited = copy.deepcopy(live)
            edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
            edited["spec"]["replicas"] = 5
            await client.replace(kube.DEPLOYMENTS, NS, "smollm2-serve", edited)
            await eventually(lambda: _get(api, "deployments", "smollm2-serve")["spec"][
                "template"]["spec"]["containers"][0]["image"] != "evil:latest", 10,
                "edit undone")
            assert _get(api, "deployments", "smollm2-serve")["spec"]["replicas"] == 1
            # hand deletion of a Deployment and of the Service
            await client.delete(kube.DEPLOYMENTS, NS, "smollm2-serve")
            await client.delete(kube.SERVICES, NS, "smollm2")
            await eventually(lambda: _get(api, "deployments", "smollm2-serve")["metadata"][
                "uid"] != uid and _get(api, "services", "smollm2"), 10, "children recreated")
            await client.close()
    run(scenario)


def test_delete_purges_the_index_and_children_go():
    async def scenario():
        purger = FakePurger()
        async with cluster() as (api, server), operator(server, purge=purger), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await client.patch(kube.POOLS, NS, NAME, {"spec": {"replicas": 2}})
            await eventually(lambda: _ready(api, 2), 5, "2 ready")
            ips = sorted(e["url"].removeprefix("http://")
                         for e in _pool(api)["status"]["endpoints"])
            await client.delete(kube.POOLS, NS, NAME)
            await eventually(lambda: purger.calls, 5, "finalizer ran")
            assert purger.calls == [(NS, NAME, ips)]
            def gone():
                return not api.store.list(api.kind("inferencepools"), NS) and not \
                    api.store.list(api.kind("deployments"), NS) and not \
                    api.store.list(api.kind("services"), NS)
            await eventually(gone, 20, "pool removed and children garbage-collected")
            await client.close()
    run(scenario)


def test_restart_converges_without_duplicates():
    async def scenario():
        async with cluster() as (api, server):
            client = kube.KubeClient.from_connection(connection(server))
            async with operator(server), controllers(api):
                await client.create(kube.POOLS, NS, CPU_POOL)
                await eventually(lambda: _ready(api, 1), 3, "ready")
            # while the operator is down: a child is deleted and the spec changes
            await client.delete(kube.PDBS, NS, "smollm2-serve")
            await client.patch(kube.POOLS, NS, NAME, {"spec": {"replicas": 2}})
            creates_before = _count_creates(api)
            async with operator(server), controllers(api):
                await eventually(lambda: _ready(api, 2), 5, "converged after restart")
                await eventually(lambda: _get(api, "poddisruptionbudgets", "smollm2-serve"),
                                 3, "PDB recreated")
            for plural in ("deployments", "services", "poddisruptionbudgets"):
                assert len(api.store.list(api.kind(plural), NS)) == 1, plural
            assert _count_creates(api) - creates_before == 1  # only the PDB
            await client.close()
    run(scenario)


def _count_creates(api) -> dict:
    return sum(1 for e in api.store.log if e.type == "ADDED"
               and e.kind.plural in ("deployments", "services", "poddisruptionbudgets"))


def test_conflicts_are_retried():
    async def scenario():
        async with cluster() as (api, server), operator(server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await eventually(lambda: _ready(api, 1), 3, "ready")
            api.fail_next("PUT", "deployments", 409, count=3)
            await client.patch(kube.POOLS, NS, NAME, {"spec": {"engine": {"maxNumSeqs": 9}}})
            def updated():
                c = _get(api, "deployments", "smollm2-serve")["spec"]["template"]["spec"][
                    "containers"][0]
                return c["args"][c["args"].index("--max-num-seqs") + 1] == "9"
            await eventually(updated, 5, "update applied despite three 409s")
            assert api.faults[0].count == 0
            await client.close()
    run(scenario)


def test_switching_to_roles_prunes_the_plain_deployment():
    async def scenario():
        async with cluster() as (api, server), operator(server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await eventually(lambda: _ready(api, 1), 3, "ready")
            await client.patch(kube.POOLS, NS, NAME, {"spec": {
                "replicas": None, "roles": {"prefill": {"replicas": 1},
                                            "decode": {"replicas": 2}}}})
            names = lambda: sorted(d["metadata"]["name"] for d in api.store.list(
                api.kind("deployments"), NS))
            await eventually(lambda: names() == ["smollm2-decode", "smollm2-prefill"], 5,
                             f"serve pruned, roles created: {names()}")
            await eventually(lambda: _ready(api, 3), 5, "3 ready across roles")
            assert set(_pool(api)["status"]["roles"]) == {"prefill", "decode"}
            await client.close()
    run(scenario)


def test_index_outage_retries_then_lets_the_deletion_finish():
    class Down:
        calls = 0

        async def __call__(self, namespace, pool, pods):
            Down.calls += 1
            raise ConnectionError("redis down")

    async def scenario():
        from sluice.operator import handlers
        handlers_attempts = handlers.PURGE_ATTEMPTS
        handlers.PURGE_ATTEMPTS = 2  # keep the test short: one retry after 5 s backoff
        try:
            async with cluster() as (api, server), operator(server, purge=Down()):
                client = kube.KubeClient.from_connection(connection(server))
                await client.create(kube.POOLS, NS, CPU_POOL)
                await eventually(lambda: _pool(api)["metadata"].get("finalizers"), 3, "finalizer")
                await client.delete(kube.POOLS, NS, NAME)
                await eventually(lambda: not api.store.list(api.kind("inferencepools"), NS), 15,
                                 "deleted despite the outage")
                assert Down.calls == 2
                await eventually(lambda: "IndexPurgeFailed" in [r for r, _ in _events(api)],
                                 3, "a Warning event about the index")
                await client.close()
        finally:
            handlers.PURGE_ATTEMPTS = handlers_attempts
    run(scenario)
