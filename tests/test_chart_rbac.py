"""The chart's operator RBAC allows every request the operator actually makes (recorded by
the emulator over a full lifecycle with peering), and nothing on Secrets: a ClusterRole
only when it serves every namespace, else a Role per watched namespace and not one
request outside them. Pool authors get aggregated ClusterRoles; each shape validates."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import pytest
import yaml
from k8s_controllers import controllers
from k8s_harness import cluster, connection, eventually, operator
from test_chart import VERSIONS, _validate, render
from test_operator_peering import _settings

from sluice.operator import kube
from sluice.operator.autoscale import LoadSample

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _allowed(rules: list[dict], verb: str, group: str, resource: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               for r in rules)


async def _peering(api, client: kube.KubeClient, namespace: str | None) -> None:
    """The chart's kopf peering CRDs, and the peering object the chart installs."""
    for crd in yaml.safe_load_all((ROOT / "charts/sluice/crds/kopf-peerings.yaml").read_text()):
        api.register_crd(crd)
    ref = kube.PEERINGS if namespace else kube.CLUSTER_PEERINGS
    kind = "KopfPeering" if namespace else "ClusterKopfPeering"
    await client.create(ref, namespace, {"apiVersion": "kopf.dev/v1", "kind": kind,
                                         "metadata": {"name": "sluice"}})


def _lifecycle(ns: str, namespaces: tuple[str, ...]):
    """Every kind of request: create, autoscale, update, drift, switch to roles, delete."""
    body = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
    body["spec"]["autoscaling"] = {"enabled": True, "maxReplicas": 2,
                                   "scaleUpStabilizationSeconds": 0}

    async def busy(endpoints, role):
        return LoadSample(0.99, 0.0, 1) if endpoints else None

    async def scenario():
        async with cluster() as (api, server), controllers(api):
            client = kube.KubeClient.from_connection(connection(server))
            client._http.headers["User-Agent"] = "test-client"  # not the operator's requests
            await _peering(api, client, ns if namespaces else None)
            async with operator(server, standalone=False, priority=1, settings=_settings(),
                                sampler=busy, autoscale_interval_s=0.2, namespaces=namespaces):
                await client.create(kube.POOLS, ns, body)
                pool = lambda: api.store.get(api.kind("inferencepools"), ns, "smollm2")
                await eventually(lambda: pool()["spec"]["replicas"] == 2, 10, "autoscaled")
                await client.patch(kube.POOLS, ns, "smollm2",
                                   {"spec": {"engine": {"maxNumSeqs": 8}}})
                await eventually(lambda: "8" in api.store.get(
                    api.kind("deployments"), ns, "smollm2-serve")["spec"]["template"][
                    "spec"]["containers"][0]["args"], 5, "updated")
                await client.delete(kube.DEPLOYMENTS, ns, "smollm2-serve")
                await eventually(lambda: api.store.get(api.kind("deployments"), ns,
                                                       "smollm2-serve"), 5, "drift repaired")
                switched = copy.deepcopy({"spec": {"replicas": None, "autoscaling": None,
                                                   "roles": {"prefill": {}, "decode": {}}}})
                await client.patch(kube.POOLS, ns, "smollm2", switched)
                # the roles' deployments and no other (a count of 2 was also met while
                # the new ones were being created, before the old one was deleted)
                await eventually(lambda: sorted(d["metadata"]["name"] for d in api.store.list(
                    api.kind("deployments"), ns)) == ["smollm2-decode",
                                                       "smollm2-prefill"], 5, "pruned")
                await client.delete(kube.POOLS, ns, "smollm2")
                await eventually(lambda: not api.store.list(api.kind("inferencepools"), ns),
                                 5, "deleted")
            await client.close()
        return [(call, namespace) for call, namespace in zip(api.calls, api.namespaces)
                if call[0].startswith(("kopf/", kube.USER_AGENT))]

    return asyncio.run(asyncio.wait_for(scenario(), 60))


def _role(manifests: list[dict], kind: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind
                and m["metadata"]["name"].endswith("-operator"))


def test_operator_cluster_role_covers_every_request_it_makes():
    calls = _lifecycle("default", ())
    made = {(verb, group, resource) for (_, verb, group, resource), _ in calls}
    verbs = {v for v, _, _ in made}
    assert {"create", "update", "patch", "delete", "watch", "list", "get"} <= verbs, made
    manifests = render("watchNamespaces={*}")
    role = _role(manifests, "ClusterRole")
    missing = sorted(c for c in made if not _allowed(role["rules"], *c))
    assert missing == [], f"requests the operator makes that its ClusterRole denies: {missing}"
    assert not any(resource == "secrets" for _, _, resource in made)
    assert not any(m["kind"] == "Role" and m["metadata"]["name"].endswith(("-operator",
                                                                           "-picker"))
                   for m in manifests)


def test_a_namespaced_operator_needs_only_roles_in_its_namespaces():
    calls = _lifecycle("team-a", ("team-a",))
    outside = sorted({(call, ns) for call, ns in calls if ns != "team-a"})
    assert outside == [], f"requests outside the watched namespace: {outside}"
    made = {(verb, group, resource) for (_, verb, group, resource), _ in calls}
    manifests = render("watchNamespaces={team-a}")
    role = _role(manifests, "Role")
    assert role["metadata"]["namespace"] == "team-a"
    missing = sorted(c for c in made if not _allowed(role["rules"], *c))
    assert missing == [], f"requests the operator makes that its Role denies: {missing}"
    binding = _role(manifests, "RoleBinding")
    assert (binding["metadata"]["namespace"], binding["roleRef"]["kind"]) == ("team-a", "Role")
    assert binding["subjects"][0]["namespace"] == "sluice"  # the operator's own namespace
    cluster_roles = {m["metadata"]["name"] for m in manifests if m["kind"] == "ClusterRole"}
    assert cluster_roles == {"rel-sluice-inferencepools-edit", "rel-sluice-inferencepools-view"}


def test_several_namespaces_get_a_role_each_for_the_operator_and_the_picker():
    manifests = render("watchNamespaces={team-a,team-b}")
    for name in ("rel-sluice-operator", "rel-sluice-picker"):
        for kind in ("Role", "RoleBinding"):
            assert sorted(m["metadata"]["namespace"] for m in manifests if m["kind"] == kind
                          and m["metadata"]["name"] == name) == ["team-a", "team-b"], (name, kind)
    assert not any(m["kind"] in ("ClusterRoleBinding",) for m in manifests)
    everywhere = render("watchNamespaces={*}")
    picker = next(m for m in everywhere if m["kind"] == "ClusterRole"
                  and m["metadata"]["name"] == "rel-sluice-picker")
    assert {v for r in picker["rules"] for v in r["verbs"]} == {"get", "list", "watch"}


def test_pool_authors_get_inferencepools_through_the_default_roles():
    manifests = render()
    edit = next(m for m in manifests if m["metadata"]["name"] == "rel-sluice-inferencepools-edit")
    view = next(m for m in manifests if m["metadata"]["name"] == "rel-sluice-inferencepools-view")
    labels = edit["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert _allowed(edit["rules"], "create", "sluice.dev", "inferencepools")
    assert _allowed(edit["rules"], "patch", "sluice.dev", "inferencepools/scale")  # kubectl scale
    assert not _allowed(edit["rules"], "patch", "sluice.dev", "inferencepools/status")  # ours
    assert {v for r in view["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    assert {r for rule in edit["rules"] + view["rules"] for r in rule["resources"]} <= {
        "inferencepools", "inferencepools/status", "inferencepools/scale"}
    off = render("operator.aggregateToDefaultRoles=false")
    assert not any("inferencepools-" in m["metadata"]["name"] for m in off)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("namespaces", ["{team-a,team-b}", "{*}"])
def test_namespace_shapes_render_valid_manifests(namespaces, version):
    _validate(render(f"watchNamespaces={namespaces}"), version)
