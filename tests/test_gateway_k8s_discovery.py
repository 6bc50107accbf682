"""Kubernetes discovery against a fake CoreV1 API + watch (same call shapes as the
`kubernetes` client: list_namespaced_pod / list_pod_for_all_namespaces,
Watch().stream(list_fn, [ns], ...)), in one, several or every namespace."""

import asyncio
import queue

import pytest

from sluice.gateway.discovery.kubernetes import (
    KubernetesDiscovery,
    parse_namespaces,
    pod_endpoint,
)


def pod(name, ip, ready=True, pool="p1", deleting=False, http=8000, namespace=None):
    return {"metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "sluice-engine",
                                    "sluice.dev/pool": pool},
                         "annotations": {"sluice.dev/model": "Qwen/Qwen3-0.6B"},
                         "deletion_timestamp": "now" if deleting else None},
            "spec": {"containers": [{"ports": [{"name": "http", "container_port": http},
                                               {"name": "kv-events", "container_port": 5557}]}]},
            "status": {"pod_ip": ip, "conditions": [{"type": "Ready",
                                                     "status": "True" if ready else "False"}]}}


class FakeAPI:
    """`pods`: the pods of its one namespace, or {namespace: pods}; one event queue per
    namespace (None: the all-namespaces watch)."""

    def __init__(self, pods):
        self.pods = pods
        self.lists = []
        self.queues: dict = {}

    def events(self, namespace=None) -> queue.Queue:
        return self.queues.setdefault(namespace, queue.Queue())

    def _items(self, namespace):
        if isinstance(self.pods, dict):
            return [p for ns, pods in self.pods.items() if namespace in (None, ns) for p in pods]
        return list(self.pods)

    def list_namespaced_pod(self, namespace, label_selector=None, **kw):
        self.lists.append((namespace, label_selector))
        return {"items": self._items(namespace), "metadata": {"resource_version": "7"}}

    def list_pod_for_all_namespaces(self, label_selector=None, **kw):
        self.lists.append(("*", label_selector))
        return {"items": self._items(None), "metadata": {"resource_version": "7"}}


class FakeWatch:
    def __init__(self, api):
        self.api = api
        self.stopped = False

    def stream(self, fn, *namespace, **kw):
        assert fn in (self.api.list_namespaced_pod, self.api.list_pod_for_all_namespaces)
        assert kw["resource_version"] == "7"
        events = self.api.events(namespace[0] if namespace else None)
        while not self.stopped:
            try:
                ev = events.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(ev, Exception):
                raise ev
            yield ev

    def stop(self):
        self.stopped = True


def test_pod_endpoint_rules():
    ep = pod_endpoint(pod("a", "10.0.0.5", http=8001), "ns")
    assert (ep.pod, ep.url, ep.model, ep.pool, ep.events, ep.replay) == (
        "10.0.0.5:8001", "http://10.0.0.5:8001", "Qwen/Qwen3-0.6B", "p1",
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert pod_endpoint(pod("a", "10.0.0.5", ready=False), "ns") is None
    assert pod_endpoint(pod("a", None), "ns") is None
    assert pod_endpoint(pod("a", "10.0.0.5", deleting=True), "ns") is None


def test_list_then_watch_then_relist_after_error():
    api = FakeAPI([pod("a", "10.0.0.1"), pod("b", "10.0.0.2", ready=False)])
    disc = KubernetesDiscovery("ns", "p1", core_v1=api, watch_factory=lambda: FakeWatch(api))
    seen = []

    async def go():
        changed = asyncio.Event()

        def on_change(eps):
            seen.append(sorted(e.pod for e in eps))
            changed.set()

        async def next_change():
            await asyncio.wait_for(changed.wait(), 5)
            changed.clear()

        await disc.start(on_change)
        await next_change()
        api.events("ns").put({"type": "MODIFIED", "object": pod("b", "10.0.0.2")})
        await next_change()
        api.events("ns").put({"type": "MODIFIED", "object": pod("b", "10.0.0.2")})  # no change
        api.events("ns").put({"type": "DELETED", "object": pod("a", "10.0.0.1")})
        await next_change()
        api.pods = [pod("c", "10.0.0.3")]
        api.events("ns").put(RuntimeError("410 Gone"))  # watch expired: re-list
        await next_change()
        await disc.stop()

    asyncio.run(go())
    assert seen == [["10.0.0.1:8000"], ["10.0.0.1:8000", "10.0.0.2:8000"], ["10.0.0.2:8000"],
                    ["10.0.0.3:8000"]]
    assert api.lists[0] == ("ns", "app.kubernetes.io/name=sluice-engine,sluice.dev/pool=p1")


def _run(disc, steps):
    """Start `disc`; for each (wanted endpoints, action): wait until the latest published
    endpoints, as sorted (namespace, pod) pairs, are the wanted ones, then run the action."""
    seen = []

    async def go():
        await disc.start(lambda eps: seen.append(sorted((e.namespace, e.pod) for e in eps)))
        for wanted, action in steps:
            for _ in range(250):
                if seen and seen[-1] == wanted:
                    break
                await asyncio.sleep(0.02)
            assert seen and seen[-1] == wanted, seen
            action()
        await disc.stop()

    asyncio.run(go())
    return seen


def test_each_namespace_the_operator_serves_is_watched():
    api = FakeAPI({"team-a": [pod("a", "10.0.0.1", namespace="team-a")],
                   "team-b": [pod("b", "10.0.0.2", namespace="team-b")],
                   "other": [pod("x", "10.0.0.9", namespace="other")]})
    disc = KubernetesDiscovery(["team-a", "team-b"], core_v1=api,
                               watch_factory=lambda: FakeWatch(api))
    both = [("team-a", "10.0.0.1:8000"), ("team-b", "10.0.0.2:8000")]
    deleted = {"type": "DELETED", "object": pod("b", "10.0.0.2", namespace="team-b")}
    _run(disc, [(both, lambda: api.events("team-b").put(deleted)),
                ([("team-a", "10.0.0.1:8000")], lambda: None)])
    assert sorted(ns for ns, _ in api.lists) == ["team-a", "team-b"]  # never "other"


def test_star_watches_every_namespace_with_one_list():
    api = FakeAPI({"team-a": [pod("a", "10.0.0.1", namespace="team-a")],
                   "other": [pod("x", "10.0.0.9", namespace="other")]})
    disc = KubernetesDiscovery("*", core_v1=api, watch_factory=lambda: FakeWatch(api))
    listed = [("other", "10.0.0.9:8000"), ("team-a", "10.0.0.1:8000")]
    added = {"type": "ADDED", "object": pod("y", "10.0.0.8", namespace="team-c")}
    _run(disc, [(listed, lambda: api.events(None).put(added)),
                (sorted([*listed, ("team-c", "10.0.0.8:8000")]), lambda: None)])
    assert api.lists == [("*", "app.kubernetes.io/name=sluice-engine")]


def test_namespace_flags():
    assert parse_namespaces(["a,b", "b", " c "]) == ("a", "b", "c")
    assert parse_namespaces(["*"]) == ("*",)
    with pytest.raises(ValueError):
        parse_namespaces(["a", "*"])
