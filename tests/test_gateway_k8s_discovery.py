"""Kubernetes discovery against a fake CoreV1 API + watch (same call shapes as the
`kubernetes` client: list_namespaced_pod, Watch().stream(list_fn, ns, ...))."""

import asyncio
import queue

from sluice.gateway.discovery.kubernetes import KubernetesDiscovery, pod_endpoint


def pod(name, ip, ready=True, pool="p1", deleting=False, http=8000):
    return {"metadata": {"name": name, "labels": {"app.kubernetes.io/name": "sluice-engine",
                                                  "sluice.dev/pool": pool},
                         "annotations": {"sluice.dev/model": "Qwen/Qwen3-0.6B"},
                         "deletion_timestamp": "now" if deleting else None},
            "spec": {"containers": [{"ports": [{"name": "http", "container_port": http},
                                               {"name": "kv-events", "container_port": 5557}]}]},
            "status": {"pod_ip": ip, "conditions": [{"type": "Ready",
                                                     "status": "True" if ready else "False"}]}}


class FakeAPI:
    def __init__(self, pods):
        self.pods = pods
        self.lists = []
        self.events: queue.Queue = queue.Queue()

    def list_namespaced_pod(self, namespace, label_selector=None, **kw):
        self.lists.append((namespace, label_selector))
        return {"items": list(self.pods), "metadata": {"resource_version": "7"}}


class FakeWatch:
    def __init__(self, api):
        self.api = api
        self.stopped = False

    def stream(self, fn, namespace, **kw):
        assert fn == self.api.list_namespaced_pod and kw["resource_version"] == "7"
        while not self.stopped:
            try:
                ev = self.api.events.get(timeout=0.05)
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
        api.events.put({"type": "MODIFIED", "object": pod("b", "10.0.0.2")})
        await next_change()
        api.events.put({"type": "MODIFIED", "object": pod("b", "10.0.0.2")})  # no change
        api.events.put({"type": "DELETED", "object": pod("a", "10.0.0.1")})
        await next_change()
        api.pods = [pod("c", "10.0.0.3")]
        api.events.put(RuntimeError("410 Gone"))  # watch expired: re-list
        await next_change()
        await disc.stop()

    asyncio.run(go())
    assert seen == [["10.0.0.1:8000"], ["10.0.0.1:8000", "10.0.0.2:8000"], ["10.0.0.2:8000"],
                    ["10.0.0.3:8000"]]
    assert api.lists[0] == ("ns", "app.kubernetes.io/name=sluice-engine,sluice.dev/pool=p1")
