"""Pod registry: what a pod leaving and coming back does to the KV-event feed."""

import asyncio
from dataclasses import replace

from polling import eventually

from sluice.gateway.discovery.health import HealthTracker
from sluice.gateway.discovery.registry import PodRegistry
from sluice.gateway.discovery.static import Endpoint
from sluice.gateway.load.table import LoadTable


class FakeFeeder:
    def __init__(self):
        self.calls = []

    def add(self, source):
        self.calls.append(("add", source.pod, source.endpoint))

    def move(self, source):
        self.calls.append(("move", source.pod, source.endpoint))

    def remove(self, pod, gone=True):
        self.calls.append(("remove", pod) if gone else ("replace", pod))


def test_a_pod_briefly_gone_keeps_its_index_and_a_pod_gone_for_good_loses_it():
    async def scenario():
        feeder = FakeFeeder()
        reg = PodRegistry(feeder, None, LoadTable(1000), HealthTracker(3, 1.0), None,
                          forget_after_s=0.3)
        removed = []
        reg.on_remove.append(removed.append)
        ep = Endpoint(pod="a:1", url="http://a:1", model="m", events="tcp://a:5557")
        reg.update([ep])
        assert feeder.calls == [("add", "a:1", "tcp://a:5557")] and reg.pods_for("m") == ["a:1"]
        reg.update([])  # not Ready: no longer routed to, but still subscribed
        assert reg.pods_for("m") == [] and removed == ["a:1"]
        assert reg.may_serve("m")  # 503, not 404, meanwhile
        await asyncio.sleep(0.1)
        reg.update([ep])  # back within the grace period
        await asyncio.sleep(0.4)
        assert feeder.calls == [("add", "a:1", "tcp://a:5557")]  # nothing purged or replayed
        reg.update([])
        await eventually(lambda: feeder.calls[-1] == ("remove", "a:1"),
                         what="gone for good once the grace period ends")
        reg.update([ep])
        reg.update([replace(ep, events="tcp://a:6000")])  # another event endpoint
        assert feeder.calls[-1] == ("move", "a:1", "tcp://a:6000")  # nothing purged here
        reg.update([replace(ep, events=None)])  # no events any more: entries go, pod stays
        assert feeder.calls[-1] == ("replace", "a:1") and reg.pods_for("m") == ["a:1"]
        reg.close()

    asyncio.run(scenario())


def test_engine_specs():
    import pytest

    from sluice.gateway.discovery.static import parse_engine_spec

    ep = parse_engine_spec("10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=ipc:///tmp/r,"
                           "model=m,pool=p")
    assert (ep.pod, ep.url, ep.events, ep.replay, ep.model, ep.pool) == (
        "10.0.0.5:8000", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "ipc:///tmp/r", "m", "p")
    for bad in ("10.0.0.5", "h:1,events=h:5557", "h:1,replay=5558", "h:1,colour=red"):
        with pytest.raises(ValueError):
            parse_engine_spec(bad)


def test_lora_adapter_requests_hit_only_blocks_cached_under_the_adapter():
    """vLLM lists adapters with a `parent` and hashes the adapter's name into its
    blocks; the events name it (`lora_name`). A request naming the adapter is
    keyed with that name: it hits the pod holding the prompt under the adapter,
    and a base-model request hits only the base model's blocks."""
    import json

    from routing_testing import Pods, make_router

    from sluice.gateway.events.translate import translate
    from sluice.gateway.index.local_index import LocalIndex
    from sluice.gateway.index.prefix_index import PrefixIndex
    from sluice.gateway.prompt.block_keys import request_keys
    from sluice.kv_events import BlockStored, KVEventBatch

    class FakeHttp:
        async def get(self, url, timeout):
            assert url.endswith("/v1/models")
            return 200, json.dumps({"data": [
                {"id": "base", "parent": None}, {"id": "alias", "parent": None},
                {"id": "ad", "parent": "base"}]}).encode()

    prompt = list(range(100, 165))  # 4 full blocks of 16 and 1 token

    def stored(lora_name, lora_id=None):
        return KVEventBatch(ts=1.0, events=[BlockStored(
            block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=prompt[:64],
            block_size=16, lora_id=lora_id, medium="GPU", lora_name=lora_name)])

    async def scenario():
        reg = PodRegistry(None, None, LoadTable(1000), HealthTracker(3, 1.0), FakeHttp())
        reg.update([Endpoint(pod=p, url=f"http://{p}", model=None) for p in ("a:1", "b:1")])
        for _ in range(100):
            if reg.pods_for("ad") == ["a:1", "b:1"]:
                break
            await asyncio.sleep(0.01)
        assert reg.key_model("a:1", "ad") == "ad" and reg.key_model("a:1", "alias") == "base"
        index = PrefixIndex(LocalIndex(), None)
        for pod, batch in (("a:1", stored("ad")), ("b:1", stored(None)),
                           ("c:1", stored(None, lora_id=7))):  # an adapter named by id only
            t = translate(batch, reg.key_model(pod, "base") or "base", lambda f: None)
            index.local.store(pod, t.stored)
        router = make_router("kv_aware", index,
                             LoadTable(1000), Pods(key_model_of=reg.key_model),
                             speculative_ttl_ms=0)
        pods = ["a:1", "b:1", "c:1"]
        for model, pod in (("ad", "a:1"), ("base", "b:1"), ("alias", "b:1")):
            d = await router.route(model, prompt, pods)
            assert (d.pod, d.hit_blocks) == (pod, 4), model
        assert index.local.lookup(request_keys("base", 16, prompt), ["c:1"], 0) == {}
        reg.close()

    asyncio.run(scenario())


def test_adapters_loaded_at_run_time_are_learned_on_configured_endpoints_too():
    import json

    listing = [{"id": "engine-name", "parent": None}]

    class FakeHttp:
        async def get(self, url, timeout):
            return 200, json.dumps({"data": listing}).encode()

    async def scenario():
        reg = PodRegistry(None, None, LoadTable(1000), HealthTracker(3, 1.0), FakeHttp())
        reg.update([Endpoint(pod="a:1", url="http://a:1", model="m")])  # configured
        await reg.refresh_models()
        assert reg.models() == ["m"] and reg.pods_for("ad") == []
        listing.append({"id": "ad", "parent": "engine-name"})  # /v1/load_lora_adapter
        await reg.refresh_models()
        assert reg.pods_for("ad") == ["a:1"] and reg.pods_for("m") == ["a:1"]
        assert (reg.key_model("a:1", "ad"), reg.key_model("a:1", "m")) == ("ad", "m")
        listing.pop()  # unloaded
        await reg.refresh_models()
        assert reg.models() == ["m"]
        reg.close()

    asyncio.run(scenario())
