"""A picker that serves one InferencePool (`--pool-name`), against the real kube-apiserver:
only the pods the pool's selector names, at its target port; a changed selector replaces
the set; a pool that is not there leaves none. GIE's InferencePool and Sluice's own."""

from __future__ import annotations

import asyncio

import pytest
from kube_chart import GIE_CRD, install_crds
from test_gateway_k8s_discovery import _create, _discover, _nothing, pod, status

from sluice.gateway.discovery import kubernetes
from sluice.gateway.discovery.kubernetes import KubernetesDiscovery
from sluice.gateway.discovery.pool_scope import (
    GIE_GROUP,
    SLUICE_GROUP,
    VERSIONS,
    PoolRef,
    PoolSelector,
    PoolUnusable,
    selector_of,
)
from sluice.operator import kube


@pytest.fixture(scope="module")
def gie_plane(kube_plane):
    install_crds(kube_plane, GIE_CRD)
    return kube_plane


def gie_pool(ns: str, match: dict[str, str], port: int = 8000) -> dict:
    return {"apiVersion": f"{GIE_GROUP}/v1", "kind": "InferencePool",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {"selector": {"matchLabels": match}, "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": "chat-epp", "port": {"number": 9002}}}}


def labelled(name: str, ip: str, ns: str, **extra: str) -> dict:
    body = pod(name, ip, namespace=ns)
    body["metadata"]["labels"].update(extra)
    return body


def test_the_pools_own_api_names_match_the_operators():
    assert (kube.GIE_POOLS.group, kube.GIE_POOLS.version) == (GIE_GROUP, VERSIONS[GIE_GROUP])
    assert (kube.POOLS.group, kube.POOLS.version) == (SLUICE_GROUP, VERSIONS[SLUICE_GROUP])
    with pytest.raises(ValueError, match="pool-group"):
        PoolRef("p", "ns", "example.com")
    with pytest.raises(ValueError, match="matchLabels is empty"):
        selector_of(PoolRef("p", "ns"), {"spec": {"selector": {}}})
    assert selector_of(PoolRef("p", "ns"), gie_pool("ns", {"b": "2", "a": "1"}, 8001)) == \
        PoolSelector("a=1,b=2", 8001)


def test_a_gie_pool_scopes_the_candidates_to_its_selector(gie_plane, kube_ns):
    """The longest prefix could sit on any pod: one outside the selector is never listed,
    so never picked. The target port is the pool's, not the pod's `http` port."""
    ns = kube_ns

    async def create_pods(api):
        await _create(api, labelled("in-a", "10.0.2.1", ns, tier="a"))
        await _create(api, labelled("in-b", "10.0.2.2", ns, tier="b"))
        await _create(api, labelled("in-a-not-ready", "10.0.2.3", ns, tier="a"))
        await api.patch(kube.PODS, ns, "in-a-not-ready", {"status": status("10.0.2.3", False)},
                        subresource="status")

    async def make_pool(api):
        await create_pods(api)
        await api.create(kube.GIE_POOLS, ns, gie_pool(ns, {"tier": "a"}, 8001))

    async def reselect(api):
        await api.patch(kube.GIE_POOLS, ns, "chat",
                        {"spec": {"selector": {"matchLabels": {"tier": "b"}}}})

    async def delete_pool(api):
        await api.delete(kube.GIE_POOLS, ns, "chat")

    disc = KubernetesDiscovery("ignored", pool_ref=PoolRef("chat", ns), refresh_s=0.2)
    seen = _discover(gie_plane, disc, [
        ([], make_pool),  # no pool yet: nothing
        ([(ns, "10.0.2.1:8001")], reselect),
        ([(ns, "10.0.2.2:8001")], delete_pool),
        ([], _nothing)])
    assert all((ns, "10.0.2.3:8001") not in s for s in seen)  # not Ready
    assert disc.namespaces == (ns,)


def test_a_sluice_pool_selects_its_own_engine_pods(kube_plane, kube_ns):
    ns = kube_ns

    async def make(api):
        await _create(api, pod("mine", "10.0.3.1", pool="chat", namespace=ns))
        await _create(api, pod("theirs", "10.0.3.2", pool="other", namespace=ns))
        await api.create(kube.POOLS, ns, {
            "apiVersion": f"{SLUICE_GROUP}/{VERSIONS[SLUICE_GROUP]}", "kind": "InferencePool",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {"model": {"name": "m"}, "replicas": 1}})

    disc = KubernetesDiscovery("ignored", pool_ref=PoolRef("chat", ns, SLUICE_GROUP),
                               refresh_s=0.2)
    _discover(kube_plane, disc, [([], make), ([(ns, "10.0.3.1:8000")], _nothing)])


def test_a_failed_read_keeps_the_pods_a_deleted_pool_drops_them(gie_plane, kube_ns,
                                                                 monkeypatch):
    """An API error reading the pool (a blip) must not empty the pool's endpoints; only the
    pool's deletion does."""
    ns = kube_ns
    real = kubernetes.read_selector
    failing = {"on": False}

    async def flaky(api, ref):
        if failing["on"]:
            raise PoolUnusable("503 Service Unavailable", gone=False)
        return await real(api, ref)
    monkeypatch.setattr(kubernetes, "read_selector", flaky)

    async def make(api):
        await _create(api, labelled("in-a", "10.0.4.1", ns, tier="a"))
        await api.create(kube.GIE_POOLS, ns, gie_pool(ns, {"tier": "a"}))

    async def fail_then_delete(api):
        failing["on"] = True
        await asyncio.sleep(1.0)  # five refreshes that fail
        assert [e.pod for e in disc._pods.values()] == ["10.0.4.1:8000"]  # kept
        failing["on"] = False
        await api.delete(kube.GIE_POOLS, ns, "chat")

    disc = KubernetesDiscovery("ignored", pool_ref=PoolRef("chat", ns), refresh_s=0.2)
    _discover(gie_plane, disc, [
        ([], make), ([(ns, "10.0.4.1:8000")], fail_then_delete), ([], _nothing)])
