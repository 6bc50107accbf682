"""apply.py against the emulator without kopf: idempotence, server-side normalisation
does not cause a replace loop, drift is replaced, foreign objects are left alone, a
concurrent writer's 409 is retried."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import yaml
from k8s_harness import cluster, connection

from sluice.operator import apply, kube
from sluice.operator.render import render_pool
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
BODY = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())


async def _owner(client) -> dict:
    """The pool the children belong to (the API server collects those of an absent owner)."""
    return await client.create(kube.POOLS, "default", BODY)


def _deployment(owner, resources=None):
    body = copy.deepcopy(owner)
    if resources:
        body["spec"]["resources"] = resources
    return next(m for m in render_pool(PoolSpec.from_body(body)) if m["kind"] == "Deployment")


def test_apply_is_idempotent_and_repairs_drift():
    async def scenario():
        async with cluster() as (_api, server):
            client = kube.KubeClient.from_connection(connection(server))
            pool = await _owner(client)
            uid = pool["metadata"]["uid"]
            memo: apply.AppliedMemo = {}
            desired = _deployment(pool)
            assert (await apply.apply_child(client, desired, uid, memo))[0] == "created"
            assert (await apply.apply_child(client, desired, uid, memo))[0] == "unchanged"
            assert (await apply.apply_child(client, desired, uid, {}))[0] == "unchanged"
            # a hand edit of the spec bumps the generation: replaced
            live = await client.get(kube.DEPLOYMENTS, "default", "smollm2-serve")
            live["spec"]["template"]["spec"]["containers"][0]["env"].append(
                {"name": "EXTRA", "value": "1"})
            await client.replace(kube.DEPLOYMENTS, "default", "smollm2-serve", live)
            assert (await apply.apply_child(client, desired, uid, memo))[0] == "updated"
            # a hand edit of our labels (no generation bump) is also repaired
            await client.patch(kube.DEPLOYMENTS, "default", "smollm2-serve",
                               {"metadata": {"labels": {"sluice.dev/role": "x"}}})
            assert (await apply.apply_child(client, desired, uid, memo))[0] == "updated"
            await client.close()
    asyncio.run(scenario())


def test_server_normalised_fields_do_not_cause_a_replace_loop():
    async def scenario():
        async with cluster() as (api, server):
            client = kube.KubeClient.from_connection(connection(server))
            pool = await _owner(client)
            uid = pool["metadata"]["uid"]
            memo: apply.AppliedMemo = {}
            desired = _deployment(pool, {"requests": {"cpu": "1000m"}})
            await apply.apply_child(client, desired, uid, memo)
            # the API server canonicalises quantities: 1000m -> 1
            def normalise(store):
                kind = api.kind("deployments")
                obj = store.get(kind, "default", "smollm2-serve")
                obj["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"][
                    "cpu"] = "1"
            await api.mutate(normalise)
            writes = len([e for e in api.store.log if e.kind.plural == "deployments"])
            for _ in range(3):
                action, _ = await apply.apply_child(client, desired, uid, memo)
                assert action == "unchanged"
            assert len([e for e in api.store.log if e.kind.plural == "deployments"]) == writes
            await client.close()
    asyncio.run(scenario())


def test_a_concurrent_writer_conflict_is_retried_with_a_fresh_read():
    async def scenario():
        async with cluster() as (_api, server):
            client = kube.KubeClient.from_connection(connection(server))
            pool = await _owner(client)
            uid = pool["metadata"]["uid"]
            await apply.apply_child(client, _deployment(pool), uid)
            real_replace = client.replace
            raced = []

            async def replace_after_a_race(ref, ns, name, body):
                if not raced:  # someone else writes between our read and our write
                    raced.append(True)
                    await client.patch(kube.DEPLOYMENTS, ns, name,
                                       {"metadata": {"annotations": {"other": "writer"}}})
                return await real_replace(ref, ns, name, body)

            client.replace = replace_after_a_race
            action, live = await apply.apply_child(
                client, _deployment(pool, {"limits": {"memory": "8Gi"}}), uid)
            assert action == "updated" and raced
            assert live["metadata"]["annotations"]["other"] == "writer"  # not clobbered
            assert live["spec"]["template"]["spec"]["containers"][0]["resources"][
                "limits"]["memory"] == "8Gi"
            await client.close()
    asyncio.run(scenario())


def test_triggers_during_a_pass_coalesce_into_one_more_pass_from_a_fresh_read():
    from sluice.operator.reconciler import Reconciler
    from sluice.operator.render import RenderConfig

    async def scenario():
        async with cluster() as (api, server):
            client = kube.KubeClient.from_connection(connection(server))
            created = await client.create(kube.POOLS, "default", BODY)
            reconciler = Reconciler(client, RenderConfig(), lambda *a: None)
            seen = []
            real_pass = reconciler._pass

            async def slow_pass(body):
                seen.append(body["spec"]["replicas"])
                if len(seen) == 1:  # while the first pass runs: a spec change + 3 triggers
                    await client.patch(kube.POOLS, "default", "smollm2",
                                       {"spec": {"replicas": 3}})
                    for _ in range(3):
                        await reconciler.reconcile(created)
                await real_pass(body)

            reconciler._pass = slow_pass
            await reconciler.reconcile(created)
            assert seen == [1, 3]  # exactly one more pass, with the re-read spec
            dep = api.store.get(api.kind("deployments"), "default", "smollm2-serve")
            assert dep["spec"]["replicas"] == 3
            await client.close()
    asyncio.run(scenario())
