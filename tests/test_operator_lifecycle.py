"""The operator (kopf + reconciler) against a real kube-apiserver and kube-controller-manager:
create, update, scale, drift, delete, restart. Each scenario runs the real operator
in-process; the pods the real Deployment controller creates are reported ready by the
kubelet stand-in."""

from __future__ import annotations

import asyncio
import copy
import json
import pathlib
from urllib.parse import unquote

import yaml
from k8s_harness import FakePurger, View, client, eventually, operator
from k8s_kubelet import kubelet

from sluice.operator import kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NAME = "smollm2"
CHILDREN = (kube.DEPLOYMENTS, kube.SERVICES, kube.PDBS)


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_create_renders_children_and_status(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            # how fast is measured by `python -m sluice.operator.bench`, not here
            await eventually(lambda: view.condition("Ready"), 10, "children and a status")
            dep = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
            assert (await view.get(kube.SERVICES, NAME))["spec"]["clusterIP"] == "None"
            assert await view.get(kube.PDBS, "smollm2-serve")
            pool = await view.pool()
            assert dep["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
            # written by server-side apply, under the operator's field manager
            managers = {m["manager"]: m["operation"] for m in dep["metadata"]["managedFields"]}
            assert managers.get("sluice-operator") == "Apply", managers
            assert (await view.condition("Ready"))["status"] == "False"  # no pods yet
            async with kubelet(api, ns):
                await eventually(lambda: view.ready(1), 20, "Ready after the pods come up")
            status = (await view.pool())["status"]
            assert status["endpoints"][0]["url"].endswith(":8000")
            assert status["selector"] == "sluice.dev/pool=smollm2,sluice.dev/role=serve"
            assert "sluice.dev/index-cleanup" in (await view.pool())["metadata"]["finalizers"]
            await eventually(lambda: _has(view, ("Created", "created Deployment/smollm2-serve")),
                             5, "a Created event")
        # children and pods are filtered by the API server, not streamed cluster-wide
        watches = [unquote(e["requestURI"]) for e in plane.audit()
                   if e["verb"] == "watch" and e.get("userAgent", "").startswith("kopf/")
                   and e["objectRef"]["resource"] in ("pods", "deployments", "services",
                                                      "poddisruptionbudgets")]
        assert len(watches) >= 4
        assert all("labelSelector=app.kubernetes.io/managed-by=sluice-operator,sluice.dev/pool"
                   in uri for uri in watches), watches
    run(scenario)


async def _has(view: View, event: tuple[str, str]) -> bool:
    return event in await view.events()


def test_spec_change_updates_children_and_scale_subresource_resizes(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,)), kubelet(api, ns)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: view.ready(1), 20, "ready")
            await api.patch(kube.POOLS, ns, NAME, {"spec": {"engine": {"maxNumSeqs": 7}}})

            async def args() -> bool:
                return await view.container_arg("smollm2-serve", "--max-num-seqs") == "7"
            await eventually(args, 10, "Deployment args updated")
            await eventually(lambda: _observed(view, 2), 10, "observedGeneration follows the spec")
            # kubectl scale / HPA path
            await api.patch(kube.POOLS, ns, NAME, {"spec": {"replicas": 3}}, subresource="scale")
            await eventually(lambda: _replicas(view, "smollm2-serve", 3), 10, "Deployment resized")
            await eventually(lambda: view.ready(3), 20, "3 ready")

            async def settled() -> dict:
                # the args change rolls out a new ReplicaSet: its surge pod counts a while
                scale = await api.get(kube.POOLS, ns, NAME, subresource="scale")
                return scale["status"]["replicas"] == 3 and scale
            scale = await eventually(settled, 20, "the rollout settled")
            assert scale["status"] == {"replicas": 3, "selector":
                                       "sluice.dev/pool=smollm2,sluice.dev/role=serve"}
            assert len((await view.pool())["status"]["endpoints"]) == 3
    run(scenario)


async def _observed(view: View, generation: int) -> bool:
    return (await view.pool())["status"]["observedGeneration"] == generation


async def _replicas(view: View, deployment: str, n: int) -> bool:
    return (await view.get(kube.DEPLOYMENTS, deployment))["spec"]["replicas"] == n


def test_drift_is_repaired(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,)), kubelet(api, ns)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: view.ready(1), 20, "ready")
            uid = (await view.get(kube.DEPLOYMENTS, "smollm2-serve"))["metadata"]["uid"]
            # a hand edit, as `kubectl edit` writes it (a PUT of the whole object)
            live = await api.get(kube.DEPLOYMENTS, ns, "smollm2-serve")
            edited = copy.deepcopy(live)
            edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
            edited["spec"]["replicas"] = 5
            await api.replace(kube.DEPLOYMENTS, ns, "smollm2-serve", edited)

            async def undone() -> bool:
                dep = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
                return (dep["spec"]["template"]["spec"]["containers"][0]["image"]
                        != "evil:latest" and dep["spec"]["replicas"] == 1)
            await eventually(undone, 10, "edit undone")
            # hand deletion of a Deployment and of the Service
            await api.delete(kube.DEPLOYMENTS, ns, "smollm2-serve")
            await api.delete(kube.SERVICES, ns, NAME)

            async def recreated() -> bool:
                dep = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
                return dep["metadata"]["uid"] != uid and bool(await view.get(kube.SERVICES, NAME))
            await eventually(recreated, 10, "children recreated")
    run(scenario)


def test_delete_purges_the_index_and_children_go(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        purger = FakePurger()
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,), purge=purger), kubelet(api, ns)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await api.patch(kube.POOLS, ns, NAME, {"spec": {"replicas": 2}})
            await eventually(lambda: view.ready(2), 20, "2 ready")
            ips = sorted(e["url"].removeprefix("http://")
                         for e in (await view.pool())["status"]["endpoints"])
            await api.delete(kube.POOLS, ns, NAME)
            await eventually(lambda: purger.calls, 10, "finalizer ran")
            assert purger.calls == [(ns, NAME, ips)]

            async def gone() -> bool:
                return not any([await view.names(kube.POOLS),
                                *[await view.names(ref) for ref in CHILDREN]])
            await eventually(gone, 30, "pool removed and children garbage-collected")
    run(scenario)


def test_restart_converges_without_duplicates(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with client(plane.admin_kubeconfig) as api, kubelet(api, ns):
            view = View(api, ns)
            async with operator(plane, namespaces=(ns,)):
                await api.create(kube.POOLS, ns, CPU_POOL)
                await eventually(lambda: view.ready(1), 20, "ready")
            uids = {ref.plural: (await view.get(ref, name))["metadata"]["uid"]
                    for ref, name in ((kube.DEPLOYMENTS, "smollm2-serve"), (kube.SERVICES, NAME))}
            # while the operator is down: a child is deleted and the spec changes
            await api.delete(kube.PDBS, ns, "smollm2-serve")
            await api.patch(kube.POOLS, ns, NAME, {"spec": {"replicas": 2}})
            async with operator(plane, namespaces=(ns,)):
                await eventually(lambda: view.ready(2), 20, "converged after restart")
                await eventually(lambda: view.get(kube.PDBS, "smollm2-serve"), 10,
                                 "PDB recreated")
            for ref in CHILDREN:
                assert len(await view.names(ref)) == 1, ref.plural
            # the others were kept, not recreated
            assert uids == {ref.plural: (await view.get(ref, name))["metadata"]["uid"]
                            for ref, name in ((kube.DEPLOYMENTS, "smollm2-serve"),
                                              (kube.SERVICES, NAME))}
    run(scenario)


def test_switching_to_roles_prunes_the_plain_deployment(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,)), kubelet(api, ns)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: view.ready(1), 20, "ready")
            await api.patch(kube.POOLS, ns, NAME, {"spec": {
                "replicas": None, "roles": {"prefill": {"replicas": 1},
                                            "decode": {"replicas": 2}}}})

            async def switched() -> bool:
                return await view.names(kube.DEPLOYMENTS) == ["smollm2-decode", "smollm2-prefill"]
            await eventually(switched, 10, "serve pruned, roles created")
            await eventually(lambda: view.ready(3), 20, "3 ready across roles")
            assert set((await view.pool())["status"]["roles"]) == {"prefill", "decode"}
    run(scenario)


def test_index_outage_retries_then_lets_the_deletion_finish(kube_plane, kube_ns, monkeypatch):
    plane, ns = kube_plane, kube_ns

    class Down:
        calls = 0

        async def __call__(self, namespace, pool, pods):
            Down.calls += 1
            raise ConnectionError("redis down")

    from sluice.operator import handlers
    monkeypatch.setattr(handlers, "PURGE_ATTEMPTS", 2)  # one retry after 5 s of backoff

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,), purge=Down())):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: _finalizers(view), 10, "finalizer")
            await api.delete(kube.POOLS, ns, NAME)
            await eventually(lambda: _no_pools(view), 20, "deleted despite the outage")
            assert Down.calls == 2

            async def warned() -> bool:
                return "IndexPurgeFailed" in [r for r, _ in await view.events()]
            await eventually(warned, 5, "a Warning event about the index")
    run(scenario)


async def _finalizers(view: View) -> list[str]:
    return (await view.pool())["metadata"].get("finalizers") or []


async def _no_pools(view: View) -> bool:
    return not await view.names(kube.POOLS)


def test_server_side_apply_takes_back_its_fields_and_keeps_others(kube_controllers, kube_ns):
    """Another manager that applies a field the operator owns is refused (409) unless it
    forces; forced, the operator takes the field back. A field only another manager set
    (an annotation) stays."""
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,)), kubelet(api, ns)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: view.ready(1), 20, "ready")
            plane.kubectl("annotate", "deployment/smollm2-serve", "-n", ns, "team=search")
            live = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
            container = live["spec"]["template"]["spec"]["containers"][0]
            theirs = {"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": "smollm2-serve", "namespace": ns},
                      "spec": {"template": {"spec": {"containers": [
                          {"name": container["name"], "image": "evil:latest"}]}}}}
            refused = plane.kubectl("apply", "--server-side", "--field-manager=someone",
                                    "-f", "-", input=json.dumps(theirs), check=False)
            assert refused.returncode and "conflict" in refused.stderr.lower(), refused
            plane.kubectl("apply", "--server-side", "--field-manager=someone",
                          "--force-conflicts", "-f", "-", input=json.dumps(theirs))

            async def taken_back() -> bool:
                dep = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
                image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
                return image == container["image"] and dep
            dep = await eventually(taken_back, 15, "the operator's image applied again")
            assert dep["metadata"]["annotations"]["team"] == "search"
    run(scenario)
