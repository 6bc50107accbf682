"""Replicas that route on their own view: the other replicas' decisions and
Redis's load entries reach it (real redis-server)."""

import asyncio
import time

import pytest
import redis
from polling import eventually
from redis_server import RedisServer

from sluice import index_keys as ik
from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.index.redis_index import RedisIndex
from sluice.gateway.index.spec_mirror import SpecMirror, parse_speculation
from sluice.gateway.load.scrape import LoadScraper
from sluice.gateway.load.table import EngineMetrics, LoadTable
from sluice.gateway.prompt.block_keys import request_keys

KEYS = request_keys("m", 4, list(range(100, 124)))  # 6 keys
PODS = ["a:1", "b:2"]


@pytest.fixture
def srv():
    with RedisServer() as s:
        yield s


def replica(srv):
    """A gateway replica's index that reads its own view, with its mirror running."""
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(srv.url, 0.5), read_local=True)
    mirror = SpecMirror(index.redis.sync, index.local, index.redis.replica_id, 60_000)
    index.redis.own_mirror = mirror.subscribed  # (as the routing core wires them)
    mirror.start()
    assert mirror.subscribed.wait(5)
    return index, mirror


def published(srv) -> int:
    """The PUBLISH calls Redis has run, its scripts' included."""
    return redis.Redis(port=srv.port).info("commandstats").get("cmdstat_publish",
                                                               {}).get("calls", 0)


def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def mirrored_after_reconnecting(srv, mirror, view):
    """Once `mirror` is subscribed again, another replica's decision reaches `view`
    (published until a subscriber takes it)."""
    until(lambda: mirror.subscribed.is_set() and redis.Redis(port=srv.port).publish(
        ik.SPEC_CHANNEL, f"other\na:1\n{time.time() * 1000 + 60_000:f}\n{KEYS[0]}"))
    until(lambda: view.lookup(KEYS, PODS, time.time() * 1000) == {"a:1": 1})


def test_a_decision_of_one_replica_reaches_the_others_view(srv):
    (a, ma), (b, mb) = replica(srv), replica(srv)
    loop = asyncio.new_event_loop()
    try:
        async def decide():
            a.speculate("b:2", KEYS[:4], ttl_ms=60_000)
            await eventually(lambda: redis.Redis(port=srv.port).zcard(ik.pod_spec_key("b:2")),
                             what="flushed: written (and published)")
        loop.run_until_complete(decide())
        until(lambda: b.local.lookup(KEYS, PODS, time.time() * 1000) == {"b:2": 4})
        found = loop.run_until_complete(b.lookup(KEYS, PODS))
        assert found.hits == {"b:2": 4} and found.loads is None  # read locally
        assert mb.mirrored == 4 and ma.mirrored == 0  # a skipped its own message
        assert redis.Redis(port=srv.port).zcard(ik.pod_spec_key("b:2")) == 4  # still shared
    finally:
        ma.stop(), mb.stop()
        loop.close()


def test_a_lone_replica_publishes_its_decisions_once_another_listens(srv):
    a, ma = replica(srv)
    mirrors = [ma]
    loop = asyncio.new_event_loop()

    async def decide(pod):
        a.speculate(pod, KEYS[:2], ttl_ms=60_000)
        await eventually(lambda: redis.Redis(port=srv.port).zcard(ik.pod_spec_key(pod)),
                         what="flushed")
    try:
        loop.run_until_complete(decide("a:1"))
        assert published(srv) == 0  # written, but only its own mirror listens
        ma.stop()
        until(lambda: not redis.Redis(port=srv.port).pubsub_numsub(ik.SPEC_CHANNEL)[0][1])
        other = redis.Redis(port=srv.port).pubsub()
        other.subscribe(ik.SPEC_CHANNEL)  # someone else listens, its own mirror does not
        loop.run_until_complete(decide("b:2"))
        assert published(srv) == 1
        other.close()
        b, mb = replica(srv)
        mirrors.append(mb)
        loop.run_until_complete(decide("c:3"))
        until(lambda: b.local.lookup(KEYS, ["c:3"], time.time() * 1000) == {"c:3": 2})
        assert published(srv) == 2
    finally:
        for m in mirrors:
            m.stop()
        loop.close()


def test_the_mirror_expires_entries_and_survives_a_redis_restart(srv):
    (b, mb) = replica(srv)
    try:
        pub = redis.Redis(port=srv.port)
        now = time.time() * 1000
        pub.publish(ik.SPEC_CHANNEL, f"other\na:1\n{now + 200:f}\n{''.join(KEYS[:2])}")
        until(lambda: b.local.lookup(KEYS, PODS, time.time() * 1000) == {"a:1": 2})
        until(lambda: b.local.lookup(KEYS, PODS, time.time() * 1000) == {})  # expired
        pub.publish(ik.SPEC_CHANNEL, b"not a speculation")  # ignored, the mirror goes on
        srv.stop()
        srv.start()
        mirrored_after_reconnecting(srv, mb, b.local)
    finally:
        mb.stop()


def test_a_connection_gone_silent_is_noticed_and_replaced(srv):
    """Redis stops answering without closing the connection (hung, or a peer gone
    behind a half-open TCP connection): the mirror's own PINGs go unanswered, it
    stops counting itself subscribed and reconnects once Redis answers again."""
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(srv.url, 0.5), read_local=True)
    mirror = SpecMirror(index.redis.sync, index.local, "me", 60_000, retry_s=0.1,
                        ping_every_s=0.2, silence_limit_s=1.0)
    mirror.start()
    try:
        assert mirror.subscribed.wait(5)
        for _ in range(100):  # idle for 1 s, but answering its PINGs: never dropped
            assert mirror.subscribed.is_set()
            time.sleep(0.01)
        srv.pause()
        try:
            until(lambda: not mirror.subscribed.is_set(), timeout=5)
        finally:
            srv.resume()
        mirrored_after_reconnecting(srv, mirror, index.local)
    finally:
        mirror.stop()


def test_parse_speculation_rejects_a_torn_keys_blob():
    assert parse_speculation(b"r\np\n5.5\n" + KEYS[0].encode()) == ("r", "p", 5.5, [KEYS[0]])
    with pytest.raises(ValueError):
        parse_speculation(b"r\np\n5.5\n" + KEYS[0].encode()[:-1])


def test_scrapes_read_back_the_newer_loads_other_replicas_wrote(srv):
    index = RedisIndex.from_url(srv.url, 0.5)
    table = LoadTable(ttl_ms=60_000)
    now = time.time() * 1000
    table.put("a:1", EngineMetrics(waiting=1, running=1, kv_usage=0.1), now - 50)
    table.put("b:2", EngineMetrics(waiting=2, running=2, kv_usage=0.2), now)
    other = {"a:1": {"waiting": 7, "running": 3, "kv_usage": 0.9, "ts_ms": now},  # newer
             "b:2": {"waiting": 9, "running": 9, "kv_usage": 0.9, "ts_ms": now - 100}}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(index.write_loads(other, 60_000))
        scraper = LoadScraper(table, index, lambda: {"a:1": "http://127.0.0.1:9"}, None)

        async def failing_get(pod, url):  # the scrape itself fails: Redis still read
            return None
        scraper._one = failing_get
        loop.run_until_complete(scraper.scrape_once())
    finally:
        loop.run_until_complete(index.aio.aclose())
        loop.close()
    fresh = table.fresh(time.time() * 1000)
    assert fresh["a:1"]["waiting"] == 7 and fresh["a:1"]["kv_usage"] == 0.9
    assert fresh["b:2"]["waiting"] == 2  # own scrape newer; b:2 was not read this time
    redis.Redis(port=index.sync.connection_pool.connection_kwargs["port"]).delete(
        ik.load_key("a:1"))  # expired in Redis: the shared row goes too
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scraper.scrape_once())
        loop.run_until_complete(index.aio.aclose())
    finally:
        loop.close()
    assert table.fresh(time.time() * 1000)["a:1"]["waiting"] == 1  # own (older) scrape


def test_a_gateway_reading_its_own_view_runs_the_mirror(srv):
    from sluice.gateway.core import CoreConfig, RoutingCore
    from sluice.gateway.discovery.static import StaticDiscovery

    gw = RoutingCore(CoreConfig(routing="kv_aware", redis_url=srv.url),
                     StaticDiscovery([]))
    assert gw.cfg.index_reads == "local"  # the default
    other = RedisIndex.from_url(srv.url, 0.5)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(gw.start())
        assert gw.mirror.subscribed.wait(5)
        other.speculate_later("a:1", KEYS[:3], 60_000, time.time() * 1000)
        loop.run_until_complete(other.flush())
        until(lambda: gw.index.local.lookup(KEYS, PODS, time.time() * 1000) == {"a:1": 3})
        before = published(srv)  # (the other's, for this mirror)
        gw.redis.speculate_later("b:2", KEYS[:3], 60_000, time.time() * 1000)
        loop.run_until_complete(gw.redis.flush())
        assert published(srv) == before  # its own decision, with no one else listening
    finally:
        loop.run_until_complete(gw.stop())
        loop.run_until_complete(other.aio.aclose())
        loop.close()
    assert not gw.mirror._thread.is_alive()


def test_a_redis_user_without_channel_rights_still_writes_speculative_entries(srv):
    """The publish is best effort: an ACL refusal neither loses the entries nor
    reads as an outage (which would switch modes and re-sync every pod)."""
    redis.Redis(port=srv.port).execute_command(
        "ACL", "SETUSER", "gw", "on", ">pw", "~*", "+@all", "resetchannels")
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(
        f"redis://gw:pw@127.0.0.1:{srv.port}/0", 0.5), read_local=True)
    loop = asyncio.new_event_loop()
    try:
        async def decide():
            index.speculate("a:1", KEYS[:3], ttl_ms=60_000)
            await asyncio.sleep(index.flush_after_s + 0.2)
        loop.run_until_complete(decide())
    finally:
        loop.close()
    assert index.mode == "redis"
    assert redis.Redis(port=srv.port).zcard(ik.pod_spec_key("a:1")) == 3


def test_a_poisoned_message_cannot_pin_a_prefix_past_the_ttl(srv):
    """Any Redis client may publish on the channel: an entry claiming an hour lasts
    at most the configured speculative TTL from its arrival."""
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(srv.url, 0.5), read_local=True)
    mirror = SpecMirror(index.redis.sync, index.local, "me", 2_000)
    mirror.start()
    try:
        assert mirror.subscribed.wait(5)
        sent = time.time() * 1000
        redis.Redis(port=srv.port).publish(
            ik.SPEC_CHANNEL, f"intruder\na:1\n{sent + 3_600_000:f}\n{KEYS[0]}")
        until(lambda: index.local.lookup(KEYS, PODS, time.time() * 1000) == {"a:1": 1})
        assert index.local.lookup(KEYS, PODS, sent + 2_000 + 1_000) == {}
    finally:
        mirror.stop()
