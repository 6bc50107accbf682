"""GIE mode on a real kube-apiserver with GIE's own InferencePool CRD (v1.6.0, in
tests/crds/gie/): the operator, logged in with the token of the chart's GIE-mode
ServiceAccount and flags, writes a GIE InferencePool per pool (the server validates it by
GIE's schema), repairs it, leaves it to the garbage collector, and the RBAC authorizer
refuses none of its requests; without GIE's CRD the pool is Degraded but its engines run."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import yaml
from k8s_harness import View, client, eventually, operator
from k8s_kubelet import kubelet
from kube_chart import (
    GIE_CRD,
    RBAC_KINDS,
    denied,
    install_crds,
    installed,
    login,
    made,
    operator_config,
    pick,
    render,
    requests_by,
    service_account,
    unique_release,
    username,
)
from test_chart import GATEWAY_FROM

from sluice import labels
from sluice.operator import kube, render_epp, render_gie
from sluice.operator.render_gie import GieConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NAME = "smollm2"
GIE = GieConfig(picker_service="rel-sluice-picker")
GROUP = render_gie.GROUP
GIE_CRD_NAME = f"{render_gie.GIE_POOLS.plural}.{GROUP}"


@pytest.fixture
def gie_crd(kube_controllers):
    """The session's API server serving GIE's InferencePool."""
    install_crds(kube_controllers, GIE_CRD)
    return kube_controllers


@pytest.fixture
def no_gie_crd(kube_controllers):
    """The session's API server without GIE's CRD (put back after, if it was there)."""
    plane = kube_controllers
    had = plane.kubectl("get", f"crd/{GIE_CRD_NAME}", check=False).returncode == 0
    plane.kubectl("delete", f"crd/{GIE_CRD_NAME}", "--ignore-not-found", "--timeout=60s")
    plane.forget_discovery()
    yield plane
    if had:
        install_crds(plane, GIE_CRD)


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 120))


async def _condition(view: View, type_: str, field: str = "status") -> str | None:
    condition = await view.condition(type_)
    return condition and condition.get(field)


def test_gie_pool_is_created_repaired_and_garbage_collected(gie_crd, kube_ns):
    plane, ns = gie_crd, kube_ns
    # the chart in GIE mode, released into the pools' namespace (its default: that one only)
    manifests = render("gie.enabled=true", GATEWAY_FROM, release=unique_release(), namespace=ns)
    picker = service_account(manifests, "-picker")[1]
    config = operator_config(manifests)
    assert config["gie"] == GieConfig(picker, failure_mode="FailClose", namespace=ns,
                                      picker_template=picker)
    assert config["namespaces"] == (ns,)
    epp = render_epp.epp_name(NAME)  # the pool's own picker, made from the chart's
    (template,) = [m for m in pick(manifests, ["Deployment"]) if m["metadata"]["name"] == picker]

    async def scenario(kubeconfig: pathlib.Path):
        async with (client(plane.admin_kubeconfig) as api, kubelet(api, ns),
                    operator(plane, kubeconfig=kubeconfig, resync_interval_s=0.5, **config)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            gie = await eventually(lambda: api.get(render_gie.GIE_POOLS, ns, NAME), 20,
                                   "the GIE pool")
            # as GIE's CRD stored it, its defaults applied
            assert gie["spec"]["endpointPickerRef"] == {
                "group": "", "kind": "Service", "name": epp, "port": {"number": 9002},
                "failureMode": "FailClose"}
            # that picker: the chart's, scoped to this pool by its GIE pool's selector
            own = await api.get(kube.DEPLOYMENTS, ns, epp)
            (container,) = own["spec"]["template"]["spec"]["containers"]
            assert container["image"] == template["spec"]["template"]["spec"]["containers"][
                0]["image"]
            assert {f"--pool-name={NAME}", f"--pool-namespace={ns}",
                    "--pool-group=inference.networking.k8s.io"} <= set(container["args"])
            assert not [a for a in container["args"] if a.startswith("--namespace=")]
            service = await api.get(kube.SERVICES, ns, epp)
            assert service["spec"]["selector"] == own["spec"]["selector"]["matchLabels"]
            assert gie["spec"]["selector"]["matchLabels"][labels.POOL] == NAME
            assert gie["spec"]["targetPorts"] == [{"number": labels.HTTP_PORT}]
            uid = (await view.pool())["metadata"]["uid"]
            assert gie["metadata"]["ownerReferences"][0]["uid"] == uid
            # the GIE pool selects exactly the pool's engine pods
            selector = ",".join(f"{k}={v}" for k, v in
                                gie["spec"]["selector"]["matchLabels"].items())
            await eventually(lambda: view.ready(1), 30,
                             "the pool Ready (the GIE pool is no problem)")
            pods = await api.list(kube.PODS, ns, label_selector=selector)
            engines = await api.list(kube.PODS, ns, label_selector=labels.engine_selector())
            assert [p["metadata"]["name"] for p in pods] == [
                p["metadata"]["name"] for p in engines] and pods
            # drift: edited by hand, then deleted by hand; the resync timer repairs both
            await api.patch(render_gie.GIE_POOLS, ns, NAME,
                            {"spec": {"endpointPickerRef": {"name": "other"}}})

            async def reverted() -> bool:
                gie = await api.get(render_gie.GIE_POOLS, ns, NAME)
                return gie["spec"]["endpointPickerRef"]["name"] == epp
            await eventually(reverted, 20, "edit reverted")
            await api.delete(render_gie.GIE_POOLS, ns, NAME)

            async def recreated() -> bool:
                gie = await api.get(render_gie.GIE_POOLS, ns, NAME)
                return gie["metadata"]["uid"] != uid and gie
            await eventually(recreated, 20, "recreated")
            # deleting the sluice pool takes the GIE pool with it (ownerReferences)
            await api.delete(kube.POOLS, ns, NAME)

            async def collected() -> bool:
                return not await api.list(render_gie.GIE_POOLS, ns) and not [
                    d for d in await api.list(kube.DEPLOYMENTS, ns)
                    if d["metadata"]["name"] == epp]
            await eventually(collected, 60, "GIE pool and the pool's picker collected")

    with installed(plane, [*pick(manifests, RBAC_KINDS), template]):
        sa = service_account(manifests, "-operator")
        _, kubeconfig = login(plane, *sa)
        run(lambda: scenario(kubeconfig))
    events = requests_by(plane, username(*sa))
    assert denied(events) == [], f"requests the chart's GIE-mode Role refused: {denied(events)}"
    calls = made(events)
    assert {("patch", GROUP, "inferencepools"), ("get", GROUP, "inferencepools")} <= calls, calls
    assert not any(resource.startswith("secrets") for _, _, resource in calls), calls
    default = next(m for m in render() if m["kind"] == "Role"
                   and m["metadata"]["name"].endswith("-operator"))
    assert not any(GROUP in r["apiGroups"] for r in default["rules"])  # only in GIE mode


def test_missing_gie_crd_degrades_the_pool_but_its_engines_still_run(no_gie_crd, kube_ns):
    plane, ns = no_gie_crd, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, kubelet(api, ns),
                    operator(plane, gie=GIE, namespaces=(ns,))):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: _is(_condition(view, "Degraded", "reason"),
                                         "GIEPoolFailed"), 20, "Degraded: GIEPoolFailed")
            message = await _condition(view, "Degraded", "message")
            assert GIE_CRD_NAME in message
            assert await view.get(kube.DEPLOYMENTS, "smollm2-serve")

            async def engines_up() -> bool:
                return (await view.pool())["status"].get("readyReplicas") == 1
            await eventually(engines_up, 30, "engines up regardless")
    run(scenario)


async def _is(value, expected) -> bool:
    return await value == expected


def test_gie_mode_skips_pools_outside_its_namespace(gie_crd, kube_ns):
    plane, ns = gie_crd, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, gie=GieConfig("picker", namespace="sluice"),
                             namespaces=(ns,))):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: _condition(view, "Ready"), 20, "reconciled")
            assert await api.list(render_gie.GIE_POOLS, ns) == []
    run(scenario)
