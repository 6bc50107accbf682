"""Pod registry: what a pod leaving and coming back does to the KV-event feed."""

import asyncio
from dataclasses import replace

from sluice.gateway.discovery import Endpoint
from sluice.gateway.health import HealthTracker
from sluice.gateway.load import LoadTable
from sluice.gateway.registry import PodRegistry


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
        await asyncio.sleep(0.4)  # gone for good
        assert feeder.calls[-1] == ("remove", "a:1")
        reg.update([ep])
        reg.update([replace(ep, events="tcp://a:6000")])  # another event endpoint
        assert feeder.calls[-1] == ("move", "a:1", "tcp://a:6000")  # nothing purged here
        reg.update([replace(ep, events=None)])  # no events any more: entries go, pod stays
        assert feeder.calls[-1] == ("replace", "a:1") and reg.pods_for("m") == ["a:1"]
        reg.close()

    asyncio.run(scenario())


def test_engine_specs():
    import pytest

    from sluice.gateway.discovery import parse_engine_spec

    ep = parse_engine_spec("10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=ipc:///tmp/r,"
                           "model=m,pool=p")
    assert (ep.pod, ep.url, ep.events, ep.replay, ep.model, ep.pool) == (
        "10.0.0.5:8000", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "ipc:///tmp/r", "m", "p")
    for bad in ("10.0.0.5", "h:1,events=h:5557", "h:1,replay=5558", "h:1,colour=red"):
        with pytest.raises(ValueError):
            parse_engine_spec(bad)
