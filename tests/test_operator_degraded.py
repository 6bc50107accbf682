"""What only the operator can detect becomes a Degraded condition with a reason and an
Event — never an exception loop — and invalid specs are rejected by the schema. On a real
API server and kube-controller-manager: the refusals are theirs (an admission policy's
422, a ResourceQuota's 403 to the ReplicaSet controller, a name already taken), and only
what a scheduler and a kubelet would report comes from the kubelet stand-in."""

from __future__ import annotations

import asyncio
import copy
import pathlib
from typing import Any

import pytest
import yaml
from k8s_harness import View, client, eventually, operator
from k8s_kubelet import kubelet
from kube_api import ControlPlane

from sluice.operator import kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NAME = "smollm2"
ADMISSION = "admissionregistration.k8s.io/v1"
QUOTAS = kube.ResourceRef("", "v1", "resourcequotas")


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 90))


async def _degraded(view: View, reason: str) -> dict[str, Any] | None:
    c = await view.condition("Degraded")
    return c if c and c["status"] == "True" and c["reason"] == reason else None


async def _not_degraded(view: View) -> bool:
    return (await view.condition("Degraded"))["status"] == "False"


async def _events(view: View, reason: str) -> list[dict[str, Any]]:
    return [e for e in await view.api.list(kube.EVENTS, view.ns) if e["reason"] == reason]


async def _warned(view: View, reason: str) -> bool:
    return any(e["type"] == "Warning" for e in await _events(view, reason))


async def _handled(view: View) -> bool:
    """kopf recorded the create handler as done: it was not failed for a retry."""
    annotations = (await view.pool())["metadata"].get("annotations") or {}
    return "sluice.dev/last-handled-configuration" in annotations


async def _poke(api: kube.KubeClient, ns: str, value: str) -> None:
    """A change to the pool that kopf hands to the update handler: one more pass."""
    await api.patch(kube.POOLS, ns, NAME, {"metadata": {"labels": {"poke": value}}})


def test_missing_pvc_and_unschedulable_gpu_become_degraded(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns
    body = copy.deepcopy(CPU_POOL)
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "weights"}}
    body["spec"]["resources"] = {"limits": {"nvidia.com/gpu": 8}}

    def unschedulable(pod):  # what the scheduler would report: no node has 8 GPUs
        return {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,)),
                    kubelet(api, ns, fate=unschedulable)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, body)
            c = await eventually(lambda: _degraded(view, "MissingPVC"), 20, "MissingPVC")
            assert f"PersistentVolumeClaim {ns}/weights not found" in c["message"]

            async def unschedulable_too() -> bool:
                c = await view.condition("Degraded")
                return "Insufficient nvidia.com/gpu" in c["message"]
            await eventually(unschedulable_too, 20, "unschedulable reported")
            assert (await view.condition("Ready"))["status"] == "False"
            await eventually(lambda: _warned(view, "MissingPVC"), 10, "a Warning event")
            # the PVC appears: only the scheduling problem is left
            await api.create(kube.PVCS, ns, {"metadata": {"name": "weights"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
            await _poke(api, ns, "1")
            c = await eventually(lambda: _degraded(view, "Unschedulable"), 20, "Unschedulable")
            assert "not found" not in c["message"]
    run(scenario)


def test_missing_secret_is_reported_from_the_pods(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    def config_error(pod):  # what the kubelet reports for a secretKeyRef to no Secret
        return {"phase": "Pending", "podIP": "10.9.0.1", "conditions": [],
                "containerStatuses": [{
                    "name": "engine", "image": "engine", "imageID": "", "ready": False,
                    "restartCount": 0, "state": {"waiting": {
                        "reason": "CreateContainerConfigError",
                        "message": 'secret "hf-token" not found'}}}]}

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,)),
                    kubelet(api, ns, fate=config_error)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            c = await eventually(lambda: _degraded(view, "MissingSecret"), 20, "MissingSecret")
            assert 'secret "hf-token" not found' in c["message"]
    run(scenario)


def test_a_name_taken_by_a_foreign_object_is_degraded_not_overwritten(kube_controllers,
                                                                       kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,)):
            view = View(api, ns)
            foreign = await api.create(kube.SERVICES, ns, {
                "metadata": {"name": NAME}, "spec": {"ports": [{"port": 80}]}})
            await api.create(kube.POOLS, ns, CPU_POOL)
            c = await eventually(lambda: _degraded(view, "ChildNotOwned"), 20,
                                 "ChildNotOwned")
            assert c["message"] == f"Service {ns}/{NAME} exists and is not owned by this pool"
            service = await view.get(kube.SERVICES, NAME)
            assert service["metadata"]["uid"] == foreign["metadata"]["uid"]
            assert service["spec"]["clusterIP"] == foreign["spec"]["clusterIP"] != "None"
            assert not service["metadata"].get("ownerReferences")
            assert await view.get(kube.DEPLOYMENTS, "smollm2-serve")  # the rest goes on
    run(scenario)


def test_schema_rejects_invalid_pools_with_the_rule_message(kube_plane, kube_ns):
    plane, ns = kube_plane, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api:
            body = copy.deepcopy(CPU_POOL)
            body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 4, "maxReplicas": 2}
            with pytest.raises(kube.ApiError) as refused:
                await api.create(kube.POOLS, ns, body)
            assert refused.value.status == 422
            assert "minReplicas must be <= autoscaling.maxReplicas" in refused.value.message
            assert not await View(api, ns).names(kube.POOLS)
    run(scenario)


def test_a_spec_the_operator_cannot_render_is_degraded_without_children(kube_controllers,
                                                                        kube_ns):
    """A spec the schema lets through but the operator refuses (a Hugging Face token as a
    literal env value, readable by anyone who can read the pool): it must not crash-loop."""
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,)):
            view = View(api, ns)
            body = copy.deepcopy(CPU_POOL)
            body["spec"]["engine"]["env"] = [{"name": "HF_TOKEN", "value": "hf_literal"}]
            await api.create(kube.POOLS, ns, body)
            c = await eventually(lambda: _degraded(view, "InvalidSpec"), 20, "InvalidSpec")
            assert "spec.engine.env HF_TOKEN must come from a Secret" in c["message"]
            await eventually(lambda: _warned(view, "InvalidSpec"), 10, "Warning event")
            await eventually(lambda: _handled(view), 10, "handled, not retried")
            assert not await view.names(kube.DEPLOYMENTS)
            # fixed by the user: converges
            await api.patch(kube.POOLS, ns, NAME, {"spec": {"engine": {"env": None}}})
            await eventually(lambda: view.names(kube.DEPLOYMENTS), 20, "children after the fix")
            await eventually(lambda: _not_degraded(view), 20, "Degraded cleared")
    run(scenario)


def _image_policy(ns: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A cluster admin's admission policy, bound to namespace `ns`: engine images only from
    the cluster's registry; a refusal is a 422 Invalid."""
    policy = {
        "apiVersion": ADMISSION, "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": f"registry-{ns}"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments"],
                "operations": ["CREATE", "UPDATE"]}]},
            "validations": [{
                "expression": "object.spec.template.spec.containers.all(c, "
                              "c.image.startsWith('registry.internal/'))",
                "message": "images must come from registry.internal", "reason": "Invalid"}]}}
    binding = {
        "apiVersion": ADMISSION, "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": f"registry-{ns}"},
        "spec": {"policyName": f"registry-{ns}", "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": ns}}}}}
    return policy, binding


def test_a_child_the_api_server_rejects_is_degraded_with_its_message_and_an_event(
        kube_controllers, kube_ns):
    """The API server refuses the Deployment (422, an admission policy the cluster admin
    set): the server's message in Degraded and in a Warning Event, the other children
    applied, and no retry loop: the pool's handler succeeds (kopf records it)."""
    plane, ns = kube_controllers, kube_ns
    policy, binding = _image_policy(ns)
    # the API server's words (a policy's refusal says "forbidden" whatever its reason)
    refused = (f'deployments.apps "smollm2-serve" is forbidden: ValidatingAdmissionPolicy '
               f"'registry-{ns}' with binding 'registry-{ns}' denied request: images must "
               "come from registry.internal")

    async def scenario():
        async with client(plane.admin_kubeconfig) as api:
            view = View(api, ns)
            async with operator(plane, namespaces=(ns,)):
                await api.create(kube.POOLS, ns, CPU_POOL)
                c = await eventually(lambda: _degraded(view, "ChildRejected"), 20,
                                     "ChildRejected")
                assert c["message"] == (f"Deployment {ns}/smollm2-serve not applied: "
                                        f"422 Invalid: {refused}")
                events = await eventually(lambda: _events(view, "ChildRejected"), 10,
                                          "an Event")
                assert events[0]["type"] == "Warning"
                assert refused in events[0]["message"]
                assert events[0]["involvedObject"]["name"] == NAME
                assert await view.get(kube.SERVICES, NAME)  # the others go on
                assert await view.get(kube.PDBS, "smollm2-serve")
                assert not await view.names(kube.DEPLOYMENTS)
                await eventually(lambda: _handled(view), 10,
                                 "the create handler done, not retried")
                # the cause is fixed (the admin lifts the policy): the next pass converges
                plane.kubectl("delete", "validatingadmissionpolicybinding",
                              binding["metadata"]["name"])
                await eventually(lambda: _admitted(plane, ns), 20, "the policy lifted")
                await _poke(api, ns, "1")
                await eventually(lambda: _not_degraded(view), 20, "Degraded cleared")
                assert await view.get(kube.DEPLOYMENTS, "smollm2-serve")

    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([policy, binding]))
    try:
        asyncio.run(eventually(lambda: not _admitted(plane, ns), 20, "the policy in force"))
        run(scenario)
    finally:
        plane.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy",
                      policy["metadata"]["name"], "--ignore-not-found", check=False)


def _admitted(plane: ControlPlane, ns: str) -> bool:
    """Whether the API server admits a Deployment in `ns` now (a dry run: nothing stored).
    Policies take effect shortly after they are written, not at once."""
    probe = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "probe"},
             "spec": {"selector": {"matchLabels": {"app": "probe"}}, "template": {
                 "metadata": {"labels": {"app": "probe"}},
                 "spec": {"containers": [{"name": "probe", "image": "example.com/probe"}]}}}}
    return plane.dry_run_create(probe, ns)[0] is not None


def test_a_deployment_replica_failure_becomes_degraded(kube_controllers, kube_ns):
    """The ReplicaSet controller's refused pod creates (here a ResourceQuota with no room
    for pods) reach the pool's status through the Deployment's ReplicaFailure condition,
    and leave with it."""
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api:
            view = View(api, ns)
            await api.create(QUOTAS, ns, {"metadata": {"name": "compute"},
                                          "spec": {"hard": {"pods": "0"}}})

            async def counted() -> bool:  # quota admission waits for the controller's count
                return bool((await api.get(QUOTAS, ns, "compute")).get("status", {}).get("hard"))
            await eventually(counted, 20, "the quota counted")
            async with operator(plane, namespaces=(ns,)):
                await api.create(kube.POOLS, ns, CPU_POOL)
                c = await eventually(lambda: _degraded(view, "ReplicaFailure"), 30,
                                     "ReplicaFailure")
                dep = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
                failure = next(d for d in dep["status"]["conditions"]
                               if d["type"] == "ReplicaFailure")
                assert failure["reason"] == "FailedCreate"
                assert "exceeded quota: compute" in failure["message"]
                assert c["message"] == (f"Deployment smollm2-serve: FailedCreate: "
                                        f"{failure['message']}")
                await eventually(lambda: _warned(view, "ReplicaFailure"), 10, "a Warning Event")
                # the quota lifted: the ReplicaSet controller creates the pod on its next try
                await api.delete(QUOTAS, ns, "compute")
                await eventually(lambda: _not_degraded(view), 60,
                                 "Degraded cleared with the condition")
                assert await view.names(kube.PODS)
    run(scenario)
