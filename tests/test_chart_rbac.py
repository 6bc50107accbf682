"""The chart's RBAC on a real kube-apiserver, whose RBAC authorizer judges every request.
The operator runs with the token of the chart's ServiceAccount, bound as the chart binds
it, through a full lifecycle with peering: the audit log must show no request refused and
none on Secrets; a ClusterRole only when it serves every namespace, else a Role per watched
namespace and not one request outside them. The picker's token may read exactly what its
discovery reads. Pool authors get InferencePools through Kubernetes' default roles."""

from __future__ import annotations

import asyncio
import json
import pathlib
import urllib.error
from urllib.parse import quote

import pytest
import yaml
from k8s_harness import client, eventually, operator, peering_settings
from k8s_kubelet import kubelet
from kube_chart import (
    CHART_CRDS,
    PEERING_KINDS,
    RBAC_KINDS,
    denied,
    install_crds,
    installed,
    login,
    made,
    namespace,
    operator_config,
    pick,
    render,
    requests_by,
    service_account,
    unique_release,
    username,
)
from test_chart import GATEWAY_FROM, VERSIONS, _validate

from sluice import labels
from sluice.operator import kube
from sluice.operator.autoscale import LoadSample

ROOT = pathlib.Path(__file__).resolve().parents[1]
POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NAME = "smollm2"


@pytest.fixture(scope="module")
def plane(kube_controllers):
    """The session's API server and controllers, with the chart's CRDs (kopf's peerings)."""
    install_crds(kube_controllers, *CHART_CRDS)
    return kube_controllers



async def _busy(endpoints, role):
    return LoadSample(0.99, 0.0, 1) if endpoints else None


def _lifecycle(plane, release_ns: str, pools_ns: str, watch: str) -> tuple[list[dict], str]:
    """Install the chart's RBAC and peering for `watchNamespaces=watch` (release in
    `release_ns`), run the operator as its ServiceAccount with the chart's flags through
    every kind of request: create, autoscale, update, drift, switch to roles, delete.
    The manifests, and the operator's user name."""
    manifests = render(f"watchNamespaces={watch}", release=unique_release(),
                       namespace=release_ns)
    body = {**POOL, "spec": {**POOL["spec"], "autoscaling": {
        "enabled": True, "maxReplicas": 2, "scaleUpStabilizationSeconds": 0}}}

    async def scenario(kubeconfig: pathlib.Path) -> None:
        async with (client(plane.admin_kubeconfig) as api, kubelet(api, pools_ns),
                    operator(plane, kubeconfig=kubeconfig, standalone=False, priority=1,
                             settings=peering_settings(), sampler=_busy, autoscale_interval_s=0.2,
                             **operator_config(manifests))):
            await api.create(kube.POOLS, pools_ns, body)

            async def spec(key: str):
                return (await api.get(kube.POOLS, pools_ns, NAME))["spec"].get(key)
            await eventually(lambda: _is(spec("replicas"), 2), 60, "autoscaled to 2")
            await api.patch(kube.POOLS, pools_ns, NAME, {"spec": {"engine": {"maxNumSeqs": 8}}})

            async def args() -> list[str]:
                dep = await api.get(kube.DEPLOYMENTS, pools_ns, "smollm2-serve")
                return dep["spec"]["template"]["spec"]["containers"][0]["args"]
            await eventually(lambda: _has(args(), "8"), 30, "updated")
            uid = (await api.get(kube.DEPLOYMENTS, pools_ns, "smollm2-serve"))["metadata"]["uid"]
            await api.delete(kube.DEPLOYMENTS, pools_ns, "smollm2-serve")

            async def recreated() -> bool:
                dep = await api.get(kube.DEPLOYMENTS, pools_ns, "smollm2-serve")
                return dep["metadata"]["uid"] != uid
            await eventually(recreated, 30, "drift repaired")
            await api.patch(kube.POOLS, pools_ns, NAME, {"spec": {
                "replicas": None, "autoscaling": None, "roles": {"prefill": {}, "decode": {}}}})

            async def deployments() -> list[str]:
                return sorted(d["metadata"]["name"]
                              for d in await api.list(kube.DEPLOYMENTS, pools_ns))
            # the roles' Deployments and no other (a count of 2 was also met while the new
            # ones were being created, before the old one was deleted)
            await eventually(lambda: _is(deployments(), ["smollm2-decode", "smollm2-prefill"]),
                             30, "pruned")
            await api.delete(kube.POOLS, pools_ns, NAME)

            async def gone() -> bool:
                return not await api.list(kube.POOLS, pools_ns)
            await eventually(gone, 30, "deleted (the finalizer removed)")

    with installed(plane, pick(manifests, RBAC_KINDS + PEERING_KINDS)):
        sa = service_account(manifests, "-operator")
        _, kubeconfig = login(plane, *sa)
        asyncio.run(asyncio.wait_for(scenario(kubeconfig), 240))
    return manifests, username(*sa)


async def _is(value, expected) -> bool:
    return await value == expected


async def _has(values, item) -> bool:
    return item in await values


def _check_requests(plane, user: str) -> list[dict]:
    """The operator's requests: none refused, none on Secrets, every kind of verb."""
    events = requests_by(plane, user)
    assert events, f"no request by {user}"
    assert denied(events) == [], f"requests the chart's RBAC refused the operator: " \
                                 f"{denied(events)}"
    calls = made(events)
    assert not any(resource.startswith("secrets") for _, _, resource in calls), calls
    verbs = {v for v, _, _ in calls}
    assert {"create", "patch", "delete", "watch", "list", "get"} <= verbs, calls
    # the children it renders, its pools' status, peering, Events
    assert {("patch", "apps", "deployments"), ("patch", "sluice.dev", "inferencepools/status"),
            ("patch", "kopf.dev", "kopfpeerings" if _namespaced(events) else
             "clusterkopfpeerings"), ("create", "", "events"),
            ("delete", "apps", "deployments")} <= calls, calls
    return events


def _namespaced(events: list[dict]) -> bool:
    return not any(e.get("objectRef", {}).get("resource") == "clusterkopfpeerings"
                   for e in events)


def _role(manifests: list[dict], kind: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind
                and m["metadata"]["name"].endswith("-operator"))


def test_operator_cluster_role_covers_every_request_it_makes(plane, kube_ns):
    with namespace(plane, "pools") as pools:
        manifests, user = _lifecycle(plane, kube_ns, pools, "{*}")
        events = _check_requests(plane, user)
    # served by the ClusterRole: pools outside the release namespace, CRD scanning
    assert {e["objectRef"].get("namespace") for e in events if e.get("objectRef")} >= {pools}
    assert ("list", "apiextensions.k8s.io", "customresourcedefinitions") in made(events)
    role = _role(manifests, "ClusterRole")
    assert not any(r in ("secrets", "*") for rule in role["rules"] for r in rule["resources"])
    assert not any(m["kind"] == "Role" and m["metadata"]["name"].endswith(("-operator",
                                                                           "-picker"))
                   for m in manifests)


def test_a_namespaced_operator_needs_only_roles_in_its_namespaces(plane, kube_ns):
    with namespace(plane, "team-a") as team_a:
        manifests, user = _lifecycle(plane, kube_ns, team_a, f"{{{team_a}}}")
        events = _check_requests(plane, user)
    outside = sorted({f"{e['verb']} {e['requestURI']}" for e in events
                      if e.get("objectRef", {}).get("namespace") != team_a
                      and not _discovery(e)})
    assert outside == [], f"requests outside the watched namespace: {outside}"
    role = _role(manifests, "Role")
    assert role["metadata"]["namespace"] == team_a
    binding = _role(manifests, "RoleBinding")
    assert (binding["metadata"]["namespace"], binding["roleRef"]["kind"]) == (team_a, "Role")
    assert binding["subjects"][0]["namespace"] == kube_ns  # the operator's own namespace
    release = binding["metadata"]["name"].removesuffix("-operator")
    cluster_roles = {m["metadata"]["name"] for m in manifests if m["kind"] == "ClusterRole"}
    assert cluster_roles == {f"{release}-inferencepools-edit", f"{release}-inferencepools-view"}


def _discovery(event: dict) -> bool:
    """API discovery (what groups and resources the server has): no object, any user may."""
    return (not event.get("objectRef") and event["verb"] == "get"
            and event["requestURI"].split("?")[0].startswith(("/api", "/apis", "/version")))


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


# What every authenticated user may do (system:basic-user): not the chart's doing.
_ANYONE = {("authorization.k8s.io", "selfsubjectaccessreviews"),
           ("authorization.k8s.io", "selfsubjectrulesreviews"),
           ("authentication.k8s.io", "selfsubjectreviews")}
# What the picker's discovery reads: engine pods, and the pools they belong to.
DISCOVERY = {(verb, group, resource) for verb in ("get", "list", "watch")
             for group, resource in (("", "pods"), ("sluice.dev", "inferencepools"))}


def _granted(plane, token: str, ns: str) -> set[tuple[str, str, str]]:
    """(verb, group, resource) the token may use in `ns`, as the server's authorizer lists
    them (SelfSubjectRulesReview, what `kubectl auth can-i --list` shows)."""
    review = plane.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
                           {"apiVersion": "authorization.k8s.io/v1",
                            "kind": "SelfSubjectRulesReview", "spec": {"namespace": ns}},
                           token=token)
    granted = set()
    for rule in review["status"]["resourceRules"]:
        assert not rule.get("resourceNames"), rule
        for group in rule.get("apiGroups", ()):
            for resource in rule["resources"]:
                if (group, resource) not in _ANYONE:
                    granted |= {(verb, group, resource) for verb in rule["verbs"]}
    return granted


def _status(plane, path: str, token: str) -> int:
    try:
        plane.request("GET", path, token=token)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


@pytest.mark.parametrize("shape", ["namespaced", "cluster-wide", "gie"])
def test_the_picker_may_read_what_its_discovery_reads_and_nothing_else(plane, kube_ns, shape):
    with namespace(plane, "pools") as other:
        # GIE mode serves pools in the release namespace only (the picker's Service is there)
        pools, elsewhere = (kube_ns, other) if shape == "gie" else (other, kube_ns)
        watch = "{*}" if shape == "cluster-wide" else f"{{{pools}}}"
        manifests = render(f"watchNamespaces={watch}", *(["gie.enabled=true", GATEWAY_FROM]
                                                         if shape == "gie" else []),
                           release=unique_release(), namespace=kube_ns)
        with installed(plane, pick(manifests, RBAC_KINDS)):
            sa = service_account(manifests, "-picker")
            token, _ = login(plane, *sa)
            # GIE mode: each pool's own picker (the same ServiceAccount) gets its GIE pool
            scoped = {("get", "inference.networking.k8s.io", "inferencepools")}
            assert _granted(plane, token, pools) == DISCOVERY | (
                scoped if shape == "gie" else set())
            # a namespace not watched: nothing there unless cluster-wide
            assert _granted(plane, token, elsewhere) == (DISCOVERY if shape == "cluster-wide"
                                                       else set())
            # the requests discovery makes: list and watch the engine pods of the namespace
            selector = quote(labels.engine_selector())
            for path in (f"/api/v1/namespaces/{pools}/pods?labelSelector={selector}",
                         (f"/api/v1/namespaces/{pools}/pods?watch=1&timeoutSeconds=1"
                          f"&labelSelector={selector}"),
                         f"/apis/sluice.dev/v1alpha1/namespaces/{pools}/inferencepools"):
                assert _status(plane, path, token) == 200, path
            everywhere = 200 if shape == "cluster-wide" else 403
            assert _status(plane, "/api/v1/pods", token) == everywhere
            assert _status(plane, f"/api/v1/namespaces/{pools}/secrets", token) == 403
            gie = f"/apis/inference.networking.k8s.io/v1/namespaces/{pools}/inferencepools"
            assert _status(plane, gie, token) == 403  # (a list: never)
            assert _status(plane, gie + "/chat", token) == (404 if shape == "gie" else 403)
        # refused: those and only those
        assert sorted(denied(requests_by(plane, username(*sa)))) == sorted([
            "list /api/v1/pods", f"list /api/v1/namespaces/{pools}/secrets",
            f"list {gie}", *([] if shape == "gie" else [f"get {gie}/chat"])][everywhere == 200:])


def test_pool_authors_get_inferencepools_through_the_default_roles(plane, kube_ns):
    manifests = render(release=unique_release(), namespace=kube_ns)
    release = _role(manifests, "Role")["metadata"]["name"].removesuffix("-operator")
    edit = next(m for m in manifests if m["metadata"]["name"] == f"{release}-inferencepools-edit")
    view = next(m for m in manifests if m["metadata"]["name"] == f"{release}-inferencepools-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {r for rule in edit["rules"] + view["rules"] for r in rule["resources"]} <= {
        "inferencepools", "inferencepools/status", "inferencepools/scale"}
    off = render("operator.aggregateToDefaultRoles=false")
    assert not any("inferencepools-" in m["metadata"]["name"] for m in off)
    # on the server: authors bound to Kubernetes' own edit and view roles in a namespace
    # (kube-controller-manager aggregates the chart's rules into them)
    authors = [{"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": role, "namespace": kube_ns}} for role in ("edit", "view")]
    bindings = [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": {"name": f"author-{role}", "namespace": kube_ns},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": role},
                 "subjects": [{"kind": "ServiceAccount", "name": role, "namespace": kube_ns}]}
                for role in ("edit", "view")]
    with installed(plane, [edit, view, *authors, *bindings]):
        tokens = {role: login(plane, kube_ns, role)[0] for role in ("edit", "view")}

        def can(role: str, verb: str, resource: str) -> bool:
            sub = resource.partition("/")[2]
            review = plane.request(
                "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                 "spec": {"resourceAttributes": {
                     "namespace": kube_ns, "verb": verb, "group": "sluice.dev",
                     "resource": "inferencepools", "subresource": sub}}},
                token=tokens[role])
            return review["status"]["allowed"]

        async def aggregated() -> bool:
            return can("edit", "create", "p") and can("view", "list", "p")
        asyncio.run(eventually(aggregated, 30, "the default roles aggregate the chart's"))
        assert can("edit", "patch", "p/scale")  # kubectl scale
        assert can("edit", "delete", "p") and can("edit", "get", "p/status")
        assert not can("edit", "patch", "p/status")  # the operator's
        assert can("view", "watch", "p") and can("view", "get", "p/scale")
        assert not any(can("view", verb, "p") for verb in ("create", "patch", "delete"))
        # and the real thing: an author creates a pool, a viewer may not
        pool = json.loads(json.dumps(POOL))
        pool["metadata"]["namespace"] = kube_ns
        plane.request("POST", f"/apis/sluice.dev/v1alpha1/namespaces/{kube_ns}/inferencepools",
                      pool, token=tokens["edit"])
        with pytest.raises(urllib.error.HTTPError) as refused:
            plane.request("PATCH", f"/apis/sluice.dev/v1alpha1/namespaces/{kube_ns}/"
                          f"inferencepools/{NAME}", {"spec": {"replicas": 2}},
                          token=tokens["view"], content_type="application/merge-patch+json")
        assert refused.value.code == 403


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("namespaces", ["{team-a,team-b}", "{*}"])
def test_namespace_shapes_render_valid_manifests(namespaces, version):
    _validate(render(f"watchNamespaces={namespaces}"), version)
