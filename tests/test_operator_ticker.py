"""The periodic loop acts only where kopf would (its peering rule, read from the same
objects), and lists the pools of the watched namespaces only."""

from __future__ import annotations

import asyncio
import datetime

from sluice.operator import kube, peering
from sluice.operator.config import OperatorConfig

NOW = datetime.datetime(2025, 1, 1, 12, 0, tzinfo=datetime.UTC)


def _peer(priority, seconds_ago=0, lifetime=60):
    seen = (NOW - datetime.timedelta(seconds=seconds_ago)).isoformat()
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen}


def test_kopfs_peering_rule():
    assert peering.acting({}, 5, NOW)  # nobody else (yet)
    assert peering.acting({"me": _peer(5)}, 5, NOW)
    assert peering.acting({"me": _peer(5), "low": _peer(3)}, 5, NOW)
    assert not peering.acting({"me": _peer(5), "high": _peer(9)}, 5, NOW)
    assert peering.acting({"me": _peer(5), "high": _peer(9, seconds_ago=61)}, 5, NOW)  # dead
    assert not peering.acting({"me": _peer(5), "twin": _peer(5)}, 5, NOW)  # a tie: all pause


class FakeClient:
    def __init__(self, objects):
        self.objects, self.gets = objects, []

    async def get(self, ref, namespace, name):
        self.gets.append((ref.plural, namespace, name))
        try:
            return self.objects[(ref.plural, namespace, name)]
        except KeyError:
            raise kube.NotFound(404, "NotFound", name) from None


def test_is_acting_reads_the_peerings_kopf_uses():
    high = {"status": {"other": {"priority": 9, "lifetime": 60,
                                 "lastseen": datetime.datetime.now(datetime.UTC).isoformat()}}}

    def acting(config, objects):
        client = FakeClient(objects)
        return asyncio.run(peering.is_acting(client, config)), client.gets

    cluster = OperatorConfig(priority=5, peering_name="sluice")
    assert acting(cluster, {("clusterkopfpeerings", None, "sluice"): {}}) == (
        True, [("clusterkopfpeerings", None, "sluice")])
    assert not acting(cluster, {("clusterkopfpeerings", None, "sluice"): high})[0]
    assert not acting(cluster, {})[0]  # no peering object: kopf pauses as well
    teams = OperatorConfig(priority=5, peering_name="sluice", namespaces=("a", "b"))
    assert acting(teams, {("kopfpeerings", "a", "sluice"): {},
                          ("kopfpeerings", "b", "sluice"): {}})[0]
    assert not acting(teams, {("kopfpeerings", "a", "sluice"): {},
                              ("kopfpeerings", "b", "sluice"): high})[0]
    assert acting(OperatorConfig(standalone=True), {}) == (True, [])
