"""What only the operator can detect becomes a Degraded condition with a reason and an
Event — never an exception loop — and invalid specs are rejected by the schema."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import kmock
import yaml
from k8s_controllers import controllers
from k8s_harness import cluster, connection, eventually, operator
from kube_emulator import ApiServerEmulator

from sluice.operator import crd, kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NS, NAME = "default", "smollm2"


def _condition(api, type_):
    pool = api.store.get(api.kind("inferencepools"), NS, NAME)
    return next((c for c in (pool.get("status") or {}).get("conditions", ())
                 if c["type"] == type_), None)


def _degraded(api, reason):
    c = _condition(api, "Degraded")
    return c if c and c["status"] == "True" and c["reason"] == reason else None


def _warnings(api):
    return [e.obj["reason"] for e in api.store.log
            if e.kind.plural == "events" and e.obj.get("type") == "Warning"]


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_missing_pvc_and_unschedulable_gpu_become_degraded():
    body = copy.deepcopy(CPU_POOL)
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "weights"}}
    body["spec"]["resources"] = {"limits": {"nvidia.com/gpu": 8}}

    def unschedulable(pod):
        return {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}

    async def scenario():
        async with cluster() as (api, server), operator(server), \
                controllers(api, fate=unschedulable):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, body)
            c = await eventually(lambda: _degraded(api, "MissingPVC"), 3, "MissingPVC")
            assert "default/weights not found" in c["message"]
            await eventually(lambda: "Insufficient nvidia.com/gpu" in _condition(
                api, "Degraded")["message"], 3, "unschedulable reported")
            assert _condition(api, "Ready")["status"] == "False"
            await eventually(lambda: "MissingPVC" in _warnings(api), 3, "a Warning event")
            # the PVC appears: only the scheduling problem is left
            await client.create(kube.PVCS, NS, {"metadata": {"name": "weights"}})
            await client.patch(kube.POOLS, NS, NAME, {"metadata": {"labels": {"poke": "1"}}})
            await eventually(lambda: _degraded(api, "Unschedulable"), 3, "Unschedulable")
            await client.close()
    run(scenario)


def test_missing_secret_is_reported_from_the_pods():
    def config_error(pod):
        return {"phase": "Pending", "podIP": "10.9.0.1", "conditions": [], "containerStatuses": [{
            "name": "engine", "state": {"waiting": {
                "reason": "CreateContainerConfigError",
                "message": 'secret "hf-token" not found'}}}]}

    async def scenario():
        async with cluster() as (api, server), operator(server), \
                controllers(api, fate=config_error):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            c = await eventually(lambda: _degraded(api, "MissingSecret"), 3, "MissingSecret")
            assert 'secret "hf-token" not found' in c["message"]
            await client.close()
    run(scenario)


def test_a_name_taken_by_a_foreign_object_is_degraded_not_overwritten():
    async def scenario():
        async with cluster() as (api, server), operator(server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.SERVICES, NS, {"metadata": {"name": NAME},
                                                    "spec": {"clusterIP": "10.0.0.9"}})
            await client.create(kube.POOLS, NS, CPU_POOL)
            c = await eventually(lambda: _degraded(api, "ChildNotOwned"), 3, "ChildNotOwned")
            assert "Service default/smollm2" in c["message"]
            assert api.store.get(api.kind("services"), NS, NAME)["spec"]["clusterIP"] == "10.0.0.9"
            assert api.store.get(api.kind("deployments"), NS, "smollm2-serve")  # the rest goes on
            await client.close()
    run(scenario)


def test_schema_rejects_invalid_pools_with_the_rule_message():
    async def scenario():
        async with cluster() as (_api, server):
            client = kube.KubeClient.from_connection(connection(server))
            body = copy.deepcopy(CPU_POOL)
            body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 4, "maxReplicas": 2}
            try:
                await client.create(kube.POOLS, NS, body)
                raise AssertionError("accepted")
            except kube.ApiError as e:
                assert e.status == 422
                assert "minReplicas must be <= autoscaling.maxReplicas" in e.message
            await client.close()
    run(scenario)


def test_a_spec_the_operator_cannot_render_is_degraded_without_children():
    """E.g. a pool stored before a schema rule existed: the operator must not crash-loop."""
    async def scenario():
        async with ApiServerEmulator() as api, kmock.Server(api) as server:
            api.register_crd(crd.render_crd())  # no validation
            async with operator(server):
                client = kube.KubeClient.from_connection(connection(server))
                body = copy.deepcopy(CPU_POOL)
                body["spec"]["roles"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
                await client.create(kube.POOLS, NS, body)
                c = await eventually(lambda: _degraded(api, "InvalidSpec"), 3, "InvalidSpec")
                assert "exactly one of spec.replicas or spec.roles" in c["message"]
                await eventually(lambda: "InvalidSpec" in _warnings(api), 3, "Warning event")
                assert not api.store.list(api.kind("deployments"), NS)
                # fixed by the user: converges
                await client.patch(kube.POOLS, NS, NAME, {"spec": {"roles": None}})
                await eventually(lambda: api.store.list(api.kind("deployments"), NS), 3,
                                 "children after the fix")
                await client.close()
    run(scenario)


def _events(api, reason):
    return [e.obj for e in api.store.log if e.kind.plural == "events" and e.type == "ADDED"
            and e.obj["reason"] == reason]


def test_a_child_the_api_server_rejects_is_degraded_with_its_message_and_an_event():
    """A 422 (here a request above its limit, which only the API server checks) on the
    Deployment's create: the server's message in Degraded and in a Warning Event, the other
    children applied, and no retry loop: the pool's handler succeeds (kopf records it)."""
    refused = ('Deployment.apps "smollm2-serve" is invalid: spec.template.spec.containers[0]'
               '.resources.requests: Invalid value: "2": must be less than or equal to cpu '
               'limit of 1')

    async def scenario():
        async with cluster() as (api, server), operator(server), controllers(api):
            api.fail_next("POST", "deployments", 422, count=100, message=refused,
                          reason="Invalid")
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            c = await eventually(lambda: _degraded(api, "ChildRejected"), 3, "ChildRejected")
            assert c["message"] == (f"Deployment {NS}/smollm2-serve not applied: "
                                    f"422 Invalid: {refused}")
            event = (await eventually(lambda: _events(api, "ChildRejected"), 3, "an Event"))[0]
            assert event["type"] == "Warning" and refused in event["message"]
            assert event["involvedObject"]["name"] == NAME
            assert api.store.get(api.kind("services"), NS, NAME)  # the others go on
            assert api.store.get(api.kind("poddisruptionbudgets"), NS, "smollm2-serve")
            await eventually(lambda: "sluice.dev/last-handled-configuration" in api.store.get(
                api.kind("inferencepools"), NS, NAME)["metadata"]["annotations"], 3,
                "the create handler done, not retried")
            # the cause is fixed (say the quota raised): the next pass converges
            api.faults.clear()
            await client.patch(kube.POOLS, NS, NAME, {"metadata": {"labels": {"poke": "1"}}})
            await eventually(lambda: _condition(api, "Degraded")["status"] == "False", 3,
                             "Degraded cleared")
            assert api.store.get(api.kind("deployments"), NS, "smollm2-serve")
            await client.close()
    run(scenario)


def test_a_deployment_replica_failure_becomes_degraded():
    """The ReplicaSet controller's refused pod creates (quota, Pod Security) reach the
    pool's status through the Deployment's ReplicaFailure condition, and leave with it."""
    failure = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
               "message": 'pods "smollm2-serve-7d9f8" is forbidden: exceeded quota: compute, '
                          "requested: requests.cpu=1, used: requests.cpu=4, limited: "
                          "requests.cpu=4"}

    async def set_conditions(api, conditions):
        def write(store):
            dep = store.get(api.kind("deployments"), NS, "smollm2-serve")
            status = {"observedGeneration": 1, "replicas": 0, "conditions": conditions}
            store.write(api.kind("deployments"), NS, "smollm2-serve", "status",
                        {**dep, "status": status}, None)
        await api.mutate(write)

    async def scenario():
        async with cluster() as (api, server), operator(server):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await eventually(lambda: api.store.get(api.kind("deployments"), NS,
                                                   "smollm2-serve"), 3, "Deployment")
            await set_conditions(api, [failure])
            c = await eventually(lambda: _degraded(api, "ReplicaFailure"), 3, "ReplicaFailure")
            assert c["message"] == f"Deployment smollm2-serve: FailedCreate: {failure['message']}"
            await eventually(lambda: _events(api, "ReplicaFailure"), 3, "a Warning Event")
            await set_conditions(api, [])
            await eventually(lambda: _condition(api, "Degraded")["status"] == "False", 3,
                             "Degraded cleared with the condition")
            await client.close()
    run(scenario)
