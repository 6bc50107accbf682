"""Kubernetes discovery against the real kube-apiserver: engine pods listed then watched
in one, several or every namespace, a watch that expires re-lists, and an API error (a
ServiceAccount not yet allowed to list pods) is retried until it passes."""

import asyncio
import secrets

import pytest
from k8s_harness import client, eventually

from sluice import kube_config
from sluice.gateway.discovery.kubernetes import (
    KubernetesDiscovery,
    parse_namespaces,
    pod_endpoint,
)
from sluice.operator import kube


def pod(name, ip=None, ready=True, pool="p1", http=8000, namespace="ns"):
    """An engine pod as the API server returns it (`ip` None: not started)."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "sluice-engine",
                                    "sluice.dev/pool": pool},
                         "annotations": {"sluice.dev/model": "Qwen/Qwen3-0.6B"}},
            "spec": {"containers": [{"name": "engine", "image": "sluice-engine:test",
                                     "ports": [{"name": "http", "containerPort": http},
                                               {"name": "kv-events", "containerPort": 5557}]}]}}
    if ip:
        body["status"] = status(ip, ready)
    return body


def status(ip, ready=True):
    return {"phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}


def test_pod_endpoint_rules():
    ep = pod_endpoint(pod("a", "10.0.0.5", http=8001), "ns")
    assert (ep.pod, ep.url, ep.model, ep.pool, ep.events, ep.replay) == (
        "10.0.0.5:8001", "http://10.0.0.5:8001", "Qwen/Qwen3-0.6B", "p1",
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert pod_endpoint(pod("a", "10.0.0.5", ready=False), "ns") is None
    assert pod_endpoint(pod("a"), "ns") is None
    deleting = pod("a", "10.0.0.5")
    deleting["metadata"]["deletionTimestamp"] = "2026-11-27T00:00:00Z"
    assert pod_endpoint(deleting, "ns") is None


async def _create(api: kube.KubeClient, body: dict) -> None:
    """A pod and, when it has one, its status (as the kubelet would report it)."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    await api.create(kube.PODS, ns, {k: v for k, v in body.items() if k != "status"})
    if "status" in body:
        await api.patch(kube.PODS, ns, name, {"status": body["status"]}, subresource="status")


def _discover(plane, disc: KubernetesDiscovery, steps, kubeconfig=None):
    """Start `disc`; for each (wanted endpoints, action): wait until the latest published
    endpoints, as sorted (namespace, pod) pairs, are the wanted ones, then await the
    action (with an admin client). Returns everything published."""
    seen = []

    async def go():
        disc.configuration = await kube_config.load(kubeconfig or plane.admin_kubeconfig)
        await disc.start(lambda eps: seen.append(sorted((e.namespace, e.pod) for e in eps)))
        try:
            async with client(plane.admin_kubeconfig) as api:
                for wanted, action in steps:
                    await eventually(lambda w=wanted: seen and seen[-1] == w, 15,
                                     f"{wanted} published (seen: {seen[-3:]})")
                    await action(api)
        finally:
            await disc.stop()

    asyncio.run(asyncio.wait_for(go(), 60))
    return seen


async def _nothing(api):
    return None


def test_list_then_watch_then_relist_on_expiry(kube_plane, kube_ns):
    ns = kube_ns

    async def setup():
        async with client(kube_plane.admin_kubeconfig) as api:
            await _create(api, pod("a", "10.0.0.1", namespace=ns))
            await _create(api, pod("b", "10.0.0.2", ready=False, namespace=ns))
            await _create(api, pod("other-pool", "10.0.0.7", pool="p2", namespace=ns))
    asyncio.run(setup())

    async def b_ready(api):
        await api.patch(kube.PODS, ns, "b", {"status": status("10.0.0.2")}, subresource="status")

    async def a_deleted(api):
        await api.delete(kube.PODS, ns, "a")

    # watches that expire every second: the discovery re-lists and keeps its view
    disc = KubernetesDiscovery(ns, "p1", watch_timeout_s=1)

    async def c_added(api):
        await eventually(lambda: disc.lists >= 2, 10, "a re-list after the watch expired")
        await _create(api, pod("c", "10.0.0.3", namespace=ns))

    seen = _discover(kube_plane, disc, [
        ([(ns, "10.0.0.1:8000")], b_ready),
        ([(ns, "10.0.0.1:8000"), (ns, "10.0.0.2:8000")], a_deleted),
        ([(ns, "10.0.0.2:8000")], c_added),
        ([(ns, "10.0.0.2:8000"), (ns, "10.0.0.3:8000")], _nothing)])
    assert all((ns, "10.0.0.7:8000") not in s for s in seen)  # another pool's pod


def test_each_namespace_the_operator_serves_is_watched(kube_plane):
    suffix = secrets.token_hex(3)
    team_a, team_b, other = (f"{n}-{suffix}" for n in ("team-a", "team-b", "other"))

    async def setup():
        async with client(kube_plane.admin_kubeconfig) as api:
            for i, ns in enumerate((team_a, team_b, other)):
                kube_plane.create_namespace(ns)
                await _create(api, pod("e", f"10.0.1.{i + 1}", namespace=ns))
    asyncio.run(setup())

    async def b_deleted(api):
        await api.delete(kube.PODS, team_b, "e")

    disc = KubernetesDiscovery([team_a, team_b])
    _discover(kube_plane, disc, [
        ([(team_a, "10.0.1.1:8000"), (team_b, "10.0.1.2:8000")], b_deleted),
        ([(team_a, "10.0.1.1:8000")], _nothing)])
    # one list per namespace served, never "other"'s
    lists = [e["objectRef"].get("namespace") for e in kube_plane.audit()
             if e["verb"] == "list" and e["objectRef"]["resource"] == "pods"
             and e["userAgent"].startswith("OpenAPI-Generator")]
    assert {team_a, team_b} <= set(lists) and other not in lists


def test_star_watches_every_namespace_with_one_list(kube_plane, kube_ns):
    ns = kube_ns

    async def setup():
        async with client(kube_plane.admin_kubeconfig) as api:
            await _create(api, pod("star", "10.0.2.1", namespace=ns))
    asyncio.run(setup())
    mark = len(kube_plane.audit())

    async def added(api):
        await _create(api, pod("star2", "10.0.2.2", namespace=ns))

    def mine(seen_last):
        return [p for p in seen_last if p[0] == ns]

    disc = KubernetesDiscovery("*", "p1")
    seen = []

    async def go():
        disc.configuration = await kube_config.load(kube_plane.admin_kubeconfig)
        await disc.start(lambda eps: seen.append(sorted((e.namespace, e.pod) for e in eps)))
        try:
            await eventually(lambda: seen and mine(seen[-1]) == [(ns, "10.0.2.1:8000")], 15)
            async with client(kube_plane.admin_kubeconfig) as api:
                await added(api)
            await eventually(lambda: mine(seen[-1]) == [(ns, "10.0.2.1:8000"),
                                                        (ns, "10.0.2.2:8000")], 15)
        finally:
            await disc.stop()
    asyncio.run(asyncio.wait_for(go(), 60))
    lists = [e for e in kube_plane.audit()[mark:]
             if e["verb"] == "list" and e["objectRef"]["resource"] == "pods"]
    assert len(lists) == 1 and "namespace" not in lists[0]["objectRef"], lists


def test_an_api_error_is_retried_until_it_passes(kube_plane, kube_ns):
    """The picker's ServiceAccount may list pods only once its Role is bound: until then
    the API server answers 403, and the discovery keeps trying."""
    ns = kube_ns
    kube_plane.kubectl("create", "serviceaccount", "picker", "-n", ns)
    kubeconfig = kube_plane.kubeconfig(kube_plane.token_for(ns, "picker"), f"picker-{ns}")

    async def setup():
        async with client(kube_plane.admin_kubeconfig) as api:
            await _create(api, pod("late", "10.0.3.1", namespace=ns))
    asyncio.run(setup())

    async def grant(api):
        kube_plane.kubectl("create", "role", "picker", "-n", ns, "--verb=get,list,watch",
                           "--resource=pods")
        kube_plane.kubectl("create", "rolebinding", "picker", "-n", ns, "--role=picker",
                           f"--serviceaccount={ns}:picker")

    disc = KubernetesDiscovery(ns, "p1")
    seen = []

    async def go():
        disc.configuration = await kube_config.load(kubeconfig)
        await disc.start(lambda eps: seen.append(sorted((e.namespace, e.pod) for e in eps)))
        try:
            await eventually(lambda: _refused(kube_plane, ns), 15, "a 403 first")
            async with client(kube_plane.admin_kubeconfig) as api:
                await grant(api)
            await eventually(lambda: seen and seen[-1] == [(ns, "10.0.3.1:8000")], 20,
                             "pods once allowed")
        finally:
            await disc.stop()
    asyncio.run(asyncio.wait_for(go(), 60))


def _refused(plane, ns) -> bool:
    return any(e["user"]["username"] == f"system:serviceaccount:{ns}:picker"
               and e["responseStatus"]["code"] == 403 for e in plane.audit())


def test_namespace_flags():
    assert parse_namespaces(["a,b", "b", " c "]) == ("a", "b", "c")
    assert parse_namespaces(["*"]) == ("*",)
    with pytest.raises(ValueError):
        parse_namespaces(["a", "*"])
