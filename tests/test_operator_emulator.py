"""The emulator behaves like an API server where the operator depends on it."""

from __future__ import annotations

import asyncio
import json
import pathlib

import yaml
from k8s_harness import cluster, connection
from k8s_store import merge_patch, selector_matches

from sluice.operator import kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())


def test_label_selectors():
    labels = {"a": "1", "b": "2"}
    assert selector_matches("a=1,b=2", labels)
    assert selector_matches("a in (1,3),!c,b", labels)
    assert not selector_matches("a!=1", labels)
    assert not selector_matches("c", labels)
    assert selector_matches("c notin (x)", labels)
    assert not selector_matches("a notin (1)", labels)


def test_merge_patch_rfc7386():
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None, "d": 3}, "l": [2]}) \
        == {"a": {"c": 2, "d": 3}, "l": [2]}


async def _scenario() -> None:
    async with cluster() as (api, server):
        client = kube.KubeClient.from_connection(connection(server))
        created = await client.create(kube.POOLS, "default", POOL)
        meta = created["metadata"]
        assert meta["uid"] and meta["generation"] == 1 and meta["resourceVersion"]
        assert created["spec"]["engine"]["blockSize"] == 16  # CRD defaults applied

        # status subresource: main-resource writes ignore status, /status only status
        patched = await client.patch(kube.POOLS, "default", "smollm2",
                                     {"status": {"replicas": 9}, "metadata": {"labels": {"x": "y"}}})
        assert "status" not in patched and patched["metadata"]["generation"] == 1
        patched = await client.patch(kube.POOLS, "default", "smollm2",
                                     {"status": {"replicas": 2}, "spec": {"replicas": 7}},
                                     subresource="status")
        assert patched["status"]["replicas"] == 2 and patched["spec"]["replicas"] == 1
        # generation moves with the spec only
        patched = await client.patch(kube.POOLS, "default", "smollm2", {"spec": {"replicas": 3}})
        assert patched["metadata"]["generation"] == 2
        # scale subresource
        scale = await client.get(kube.POOLS, "default", "smollm2", subresource="scale")
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
        await client.patch(kube.POOLS, "default", "smollm2", {"spec": {"replicas": 4}},
                           subresource="scale")
        assert (await client.get(kube.POOLS, "default", "smollm2"))["spec"]["replicas"] == 4

        # optimistic concurrency
        stale = dict(patched)
        try:
            await client.replace(kube.POOLS, "default", "smollm2", stale)
            raise AssertionError("stale resourceVersion accepted")
        except kube.Conflict as e:
            assert "has been modified" in e.message
        try:
            await client.create(kube.POOLS, "default", POOL)
            raise AssertionError("duplicate create accepted")
        except kube.Conflict as e:
            assert e.reason == "AlreadyExists"
        # schema validation with a clear message
        bad = json.loads(json.dumps(POOL))
        bad["metadata"]["name"] = "bad"
        bad["spec"]["roles"] = {"prefill": {}, "decode": {}}
        try:
            await client.create(kube.POOLS, "default", bad)
            raise AssertionError("invalid pool accepted")
        except kube.ApiError as e:
            assert e.status == 422 and "set exactly one of spec.replicas" in e.message

        # label selectors on lists, finalizers and garbage collection
        owner = (await client.get(kube.POOLS, "default", "smollm2"))["metadata"]["uid"]
        await client.create(kube.SERVICES, "default", {"metadata": {
            "name": "child", "labels": {"sluice.dev/pool": "smollm2"},
            "ownerReferences": [{"uid": owner, "name": "smollm2", "kind": "InferencePool",
                                 "apiVersion": "sluice.dev/v1alpha1", "controller": True}]}})
        await client.create(kube.SERVICES, "default", {"metadata": {"name": "other"}})
        assert [s["metadata"]["name"] for s in await client.list(
            kube.SERVICES, "default", "sluice.dev/pool=smollm2")] == ["child"]
        await client.patch(kube.POOLS, "default", "smollm2",
                           {"metadata": {"finalizers": ["test/hold"]}})
        await client.delete(kube.POOLS, "default", "smollm2")
        held = await client.get(kube.POOLS, "default", "smollm2")
        assert held["metadata"]["deletionTimestamp"]
        await client.patch(kube.POOLS, "default", "smollm2", {"metadata": {"finalizers": None}})
        for ref, name in ((kube.POOLS, "smollm2"), (kube.SERVICES, "child")):
            try:
                await client.get(ref, "default", name)
                raise AssertionError(f"{name} survived")
            except kube.NotFound:
                pass
        assert (await client.get(kube.SERVICES, "default", "other"))
        # a dependent created after its owner went (a pass that raced the deletion) goes too
        await client.create(kube.SERVICES, "default", {"metadata": {
            "name": "late-child", "ownerReferences": [{
                "uid": owner, "name": "smollm2", "kind": "InferencePool",
                "apiVersion": "sluice.dev/v1alpha1", "controller": True}]}})
        try:
            await client.get(kube.SERVICES, "default", "late-child")
            raise AssertionError("a dependent of a deleted owner survived")
        except kube.NotFound:
            pass

        # watches resume from a resourceVersion
        since = api.store.rv
        await client.create(kube.SERVICES, "default", {"metadata": {"name": "late"}})
        async with api.get(f"/api/v1/namespaces/default/services?watch=true&resourceVersion="
                           f"{since}&timeoutSeconds=1") as resp:
            lines = [json.loads(line) for line in (await resp.read()).splitlines() if line]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("ADDED", "late")]
        await client.close()


def test_emulator_semantics():
    asyncio.run(_scenario())
