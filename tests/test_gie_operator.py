"""GIE mode against the emulated API server: the operator writes a GIE InferencePool per pool
(validated by the emulator against GIE's v1 schema, as the real CRD would), repairs it,
leaves it to the garbage collector, degrades the pool when GIE's CRD is missing, and the
chart's GIE-mode ClusterRole allows every request it makes."""

from __future__ import annotations

import asyncio
import pathlib

import yaml
from k8s_controllers import controllers
from k8s_harness import cluster, connection, eventually, operator
from k8s_store import Kind
from test_chart import render
from test_chart_rbac import _allowed
from test_gie_render import gie_errors

from sluice.operator import kube, render_gie
from sluice.operator.render_gie import GieConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NS, NAME = "default", "smollm2"
GIE = GieConfig(picker_service="rel-sluice-picker")
GROUP = render_gie.GROUP


def install_gie_crd(api) -> None:
    """Serve GIE's InferencePool and validate it with GIE's schema. The emulator keys
    validators by plural, which ours shares, so one validator dispatches on the group."""
    api.register(Kind(GROUP, "v1", "inferencepools", "InferencePool", True, ("status",)))
    ours = api.store.validators["inferencepools"]

    def validate(obj):
        if obj.get("apiVersion", "").startswith(GROUP + "/"):
            return obj, gie_errors(obj)
        return ours(obj)
    api.store.validators["inferencepools"] = validate


def _gie(api):
    return api.store.get(api.kind("inferencepools", GROUP), NS, NAME)


def _ours(api):
    return api.store.get(api.kind("inferencepools", "sluice.dev"), NS, NAME)


def _condition(api, type_):
    return next(c for c in _ours(api)["status"]["conditions"] if c["type"] == type_)


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_gie_pool_is_created_repaired_and_garbage_collected():
    async def scenario():
        async with cluster() as (api, server), controllers(api):
            install_gie_crd(api)
            # the pools' namespace only, as the chart runs it by default (its Role, below)
            async with operator(server, gie=GIE, resync_interval_s=0.5, namespaces=(NS,)):
                client = kube.KubeClient.from_connection(connection(server))
                client._http.headers["User-Agent"] = "test-client"
                await client.create(kube.POOLS, NS, CPU_POOL)
                gie = await eventually(lambda: _gie(api), 5, "the GIE pool")
                assert gie_errors(gie) == []  # also as stored, server fields included
                uid = _ours(api)["metadata"]["uid"]
                assert gie["metadata"]["ownerReferences"][0]["uid"] == uid
                assert gie["spec"]["endpointPickerRef"]["name"] == "rel-sluice-picker"
                await eventually(lambda: _condition(api, "Ready")["status"] == "True", 5,
                                 "the pool Ready (the GIE pool is no problem)")
                # drift: edited by hand, then deleted by hand; the resync timer repairs both
                await client.patch(render_gie.GIE_POOLS, NS, NAME,
                                   {"spec": {"endpointPickerRef": {"name": "other"}}})
                await eventually(lambda: _gie(api)["spec"]["endpointPickerRef"]["name"]
                                 == "rel-sluice-picker", 5, "edit reverted")
                await client.delete(render_gie.GIE_POOLS, NS, NAME)
                await eventually(lambda: _gie(api), 5, "recreated")
                # deleting the sluice pool takes the GIE pool with it (ownerReferences)
                await client.delete(kube.POOLS, NS, NAME)
                await eventually(lambda: not api.store.list(
                    api.kind("inferencepools", GROUP), NS), 5, "GIE pool collected")
                await client.close()
        return api.calls

    calls = run(scenario)
    made = {(verb, group, resource) for agent, verb, group, resource in calls
            if agent.startswith(("kopf/", kube.USER_AGENT))}
    assert {("create", GROUP, "inferencepools"), ("update", GROUP, "inferencepools"),
            ("get", GROUP, "inferencepools")} <= made
    role = next(m for m in render("gie.enabled=true") if m["kind"] == "Role"
                and m["metadata"]["name"].endswith("-operator"))
    missing = sorted(c for c in made if not _allowed(role["rules"], *c))
    assert missing == [], f"requests the operator makes that its Role denies: {missing}"
    default = next(m for m in render() if m["kind"] == "Role"
                   and m["metadata"]["name"].endswith("-operator"))
    assert not any(GROUP in r["apiGroups"] for r in default["rules"])  # only in GIE mode


def test_missing_gie_crd_degrades_the_pool_but_its_engines_still_run():
    async def scenario():
        async with cluster() as (api, server), controllers(api), operator(server, gie=GIE):
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            await eventually(lambda: _condition(api, "Degraded")["reason"] == "GIEPoolFailed",
                             5, "Degraded: GIEPoolFailed")
            message = _condition(api, "Degraded")["message"]
            assert "inferencepools.inference.networking.k8s.io" in message
            assert api.store.get(api.kind("deployments"), NS, "smollm2-serve")
            await eventually(lambda: _ours(api)["status"].get("readyReplicas") == 1, 5,
                             "engines up regardless")
            await client.close()
    run(scenario)


def test_gie_mode_skips_pools_outside_its_namespace():
    async def scenario():
        async with cluster() as (api, server):
            install_gie_crd(api)
            async with operator(server, gie=GieConfig("picker", namespace="sluice")):
                client = kube.KubeClient.from_connection(connection(server))
                await client.create(kube.POOLS, NS, CPU_POOL)
                await eventually(lambda: _ours(api).get("status", {}).get("conditions"), 5,
                                 "reconciled")
                assert api.store.list(api.kind("inferencepools", GROUP), NS) == []
                await client.close()
    run(scenario)
