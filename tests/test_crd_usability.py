"""CRD usability: every field described (what `kubectl explain` prints), quantities
validated as Kubernetes quantities, rollout and disruption settings that reach the
children, and a status whose `replicas` and `selector` describe the same pods."""

from __future__ import annotations

import asyncio
import copy
import pathlib
import time

import pytest
import yaml
from k8s_harness import client, eventually, operator
from k8s_kubelet import kubelet

from sluice.operator import crd, kube
from sluice.operator.render import render_pool
from sluice.operator.spec import PoolSpec, SpecError

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "charts" / "sluice" / "examples"
SCHEMA = crd.render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _base() -> dict:
    body = yaml.safe_load((EXAMPLES / "pool-cpu.yaml").read_text())
    body["metadata"]["uid"] = "uid-1"
    return body


def _undescribed(schema: dict, path: str) -> list[str]:
    missing = [] if schema.get("description") else [path]
    for name, sub in (schema.get("properties") or {}).items():
        missing += _undescribed(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            missing += _undescribed(schema[key], f"{path}[{key}]")
    return missing


def test_every_field_is_described(kube_plane):
    """What `kubectl explain` prints, from the real server's OpenAPI (the root's metadata
    is the server's own, ObjectMeta)."""
    # the server publishes a new CRD's OpenAPI a few seconds after establishing it
    deadline = time.monotonic() + 30
    while (done := kube_plane.kubectl("explain", "spool.spec.autoscaling", check=False)
           ).returncode and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "targetKVCacheUsage" in done.stdout and "Fewest replicas." in done.stdout, done
    spec = SCHEMA["properties"]["spec"]
    assert _undescribed(spec, "spool.spec") == []
    assert _undescribed(SCHEMA["properties"]["status"], "spool.status") == []


def _errors(plane, spec_patch: dict) -> list[str]:
    body = _base()
    body["spec"].update(copy.deepcopy(spec_patch))
    return plane.dry_run_create(body)[1]


@pytest.mark.parametrize("value", ["500m", "2", 4, "1.5", "16Gi", "0.5Gi", "1e3", "128974848",
                                   "100M", ".5"])
def test_kubernetes_quantities_are_accepted(kube_plane, value):
    assert _errors(kube_plane, {"resources": {"requests": {"cpu": value}, "limits": {"memory": value}},
                    "modelCache": {"sizeLimit": value}}) == []


@pytest.mark.parametrize("value", ["1x", "-1", "2 Gi", "Gi", "1.5.2", "16GB", "", -2])
def test_what_is_not_a_quantity_is_rejected_by_the_schema(kube_plane, value):
    for patch in ({"resources": {"limits": {"nvidia.com/gpu": value}}},
                  {"modelCache": {"sizeLimit": value}}):
        assert _errors(kube_plane, patch), patch


def test_rollout_and_disruption_reach_the_children(kube_plane):
    body = _base()
    body["spec"]["rollout"] = {"maxSurge": 0, "maxUnavailable": "25%"}
    body["spec"]["podDisruptionBudget"] = {"minAvailable": "50%"}
    defaulted, errors = kube_plane.dry_run_create(body)
    assert errors == []
    kinds = {m["kind"]: m for m in render_pool(PoolSpec.from_body(defaulted))}
    assert kinds["Deployment"]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0, "maxUnavailable": "25%"}
    assert kinds["PodDisruptionBudget"]["spec"]["minAvailable"] == "50%"
    assert "maxUnavailable" not in kinds["PodDisruptionBudget"]["spec"]
    # defaults: a new engine before an old one goes, one engine down at most
    kinds = {m["kind"]: m for m in render_pool(PoolSpec.from_body(_base()))}
    assert kinds["Deployment"]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1, "maxUnavailable": 0}
    assert kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    body["spec"]["podDisruptionBudget"] = {"enabled": False}
    assert "PodDisruptionBudget" not in {m["kind"] for m in render_pool(PoolSpec.from_body(body))}


@pytest.mark.parametrize("patch,message", [
    ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}, "cannot both be 0"),
    ({"rollout": {"maxSurge": "25"}}, "maxSurge in body should match"),
    ({"rollout": {"maxUnavailable": -1}}, "should be greater than or equal to 0"),
    ({"podDisruptionBudget": {"maxUnavailable": 1, "minAvailable": 1}}, "not both"),
])
def test_invalid_rollout_and_disruption_settings_are_rejected(kube_plane, patch, message):
    errors = _errors(kube_plane, patch)
    assert any(message in e for e in errors), errors
    if "should" not in message:
        body = _base()
        body["spec"].update(patch)
        with pytest.raises(SpecError, match=message):  # and by the operator's own parser
            PoolSpec.from_body(body)


async def _matching(api: kube.KubeClient, namespace: str, selector: str) -> list[dict]:
    """The pods `selector` selects, as the API server filters them."""
    return await api.list(kube.PODS, namespace, label_selector=selector)


@pytest.mark.parametrize("example", ["pool-cpu.yaml", "pool-disaggregated.yaml"])
def test_status_replicas_count_the_pods_its_selector_selects(example, kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns
    body = yaml.safe_load((EXAMPLES / example).read_text())
    name = body["metadata"]["name"]

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,)),
                    kubelet(api, ns)):
            await api.create(kube.POOLS, ns, body)
            # (the roles' Deployments report one after the other: a status counting only
            # the first is consistent but not settled, so wait for every desired pod)
            spec = body["spec"]
            desired = (sum(r["replicas"] for r in spec["roles"].values()) if "roles" in spec
                       else spec["replicas"])

            async def settled() -> bool:
                status = (await api.get(kube.POOLS, ns, name)).get("status") or {}
                return (status.get("readyReplicas") == desired and sum(
                    r["replicas"] for r in status["roles"].values()) == desired
                    and len(await _matching(api, ns, status["selector"])) == desired)

            await eventually(settled, 60, "ready")
            status = (await api.get(kube.POOLS, ns, name))["status"]
            assert len(await _matching(api, ns, status["selector"])) == status["replicas"]
            for role in status["roles"].values():
                assert len(await _matching(api, ns, role["selector"])) == role["replicas"]
            if "roles" in spec:
                # the scale subresource serves spec.replicas, which a prefill/decode pool
                # lacks: the API server refuses a GET of it, as its CRD docs say
                with pytest.raises(kube.ApiError, match="spec.replicas.* does not exist"):
                    await api.get(kube.POOLS, ns, name, subresource="scale")
                return
            scale = await api.get(kube.POOLS, ns, name, subresource="scale")
            assert scale["status"] == {"replicas": status["replicas"],
                                       "selector": status["selector"]}
    asyncio.run(asyncio.wait_for(scenario(), 120))
