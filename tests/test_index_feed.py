"""Prefix index fed by real KV-event publishers, with a real redis-server."""

import asyncio
import time

import pytest
import redis
import zmq
from polling import eventually, wait_for
from redis_server import RedisServer

from sluice import index_keys as ik
from sluice.engine.kv_publisher import KVEventPublisher
from sluice.gateway.events.feed import EventFeeder
from sluice.gateway.events.sockets import EventSource, PodState
from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.index.redis_index import RedisIndex
from sluice.gateway.prompt.block_keys import request_keys
from sluice.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)

BS = 4
MODEL = "m"


def stored(hashes, parent, tokens, bs=BS):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, lora_id=None, medium="GPU", lora_name=None)


class Engine:
    """A KV-event publisher standing in for one engine's block manager."""

    def __init__(self, name, seed):
        self.pub = KVEventPublisher("tcp://127.0.0.1:0".replace("127.0.0.1", "*"),
                                    "tcp://*:0", topic=f"kv@{name}@{MODEL}")
        self.pod = name
        self.seed = seed

    def source(self):
        fix = lambda e: e.replace("0.0.0.0", "127.0.0.1")
        return EventSource(self.pod, MODEL, fix(self.pub.last_endpoint),
                           fix(self.pub.last_replay_endpoint))

    def h(self, i):  # engine hashes differ per engine (own seed)
        return self.seed * 1000 + i


def make_index(port):
    if port is None:
        return PrefixIndex(LocalIndex(), None)
    return PrefixIndex(LocalIndex(), RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", 0.5),
                       lookup_timeout_s=2.0)


LOOP = asyncio.new_event_loop()


@pytest.fixture(scope="module", autouse=True)
def _close_loop():
    yield
    LOOP.close()


def spec_entries(index, pod):
    """`pod`'s speculative entries in Redis (what a flush writes)."""
    return index.redis.sync.zcard(ik.pod_spec_key(pod))


def restarted_publisher(source):
    """A new publisher on the endpoints of `source` (a restarted engine). ZMQ closes
    sockets in its I/O thread, so the old ports may still be bound for a moment."""
    port = source.endpoint.rsplit(":", 1)[1]
    rport = source.replay_endpoint.rsplit(":", 1)[1]
    deadline = time.monotonic() + 10
    while True:
        try:
            return KVEventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}", topic="t")
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def publish_until(pub, cond, timeout=10.0):
    """Publish harmless batches (removal of a block nobody holds) until `cond()`:
    a subscriber drops what was sent before its connection was live."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        pub.publish([BlockRemoved(block_hashes=[987654321], medium="GPU")])
        time.sleep(0.2)


def hits(index, tokens, pods):
    return LOOP.run_until_complete(index.lookup(request_keys(MODEL, BS, tokens), pods)).hits


def held(index, pods):
    """Keys held per pod, as a lookup reads them from Redis, and in the local view."""
    found = LOOP.run_until_complete(index.lookup(request_keys(MODEL, BS, TOKENS), pods))
    assert found.loads is not None, "read from Redis"
    assert found.held == index.local.held(pods)
    return found.held


TOKENS = list(range(100, 124))  # 6 blocks of 4


@pytest.fixture
def srv():
    with RedisServer() as s:
        yield s


def test_store_remove_clear_and_pod_gone(srv):
    a, b = Engine("a:1", 1), Engine("b:2", 2)
    index = make_index(srv.port)
    feeder = EventFeeder(index)
    feeder.start()
    try:
        feeder.add(a.source())
        feeder.add(b.source())
        time.sleep(0.3)
        a.pub.publish([stored([a.h(0), a.h(1)], None, TOKENS[:8]),
                       stored([a.h(2), a.h(3)], a.h(1), TOKENS[8:16])])
        b.pub.publish([stored([b.h(0)], None, TOKENS[:4])])
        wait_for(lambda: feeder.batches >= 2)
        assert hits(index, TOKENS, ["a:1", "b:2"]) == {"a:1": 4, "b:2": 1}
        assert index.local.lookup(request_keys(MODEL, BS, TOKENS), ["a:1", "b:2"],
                                  0) == {"a:1": 4, "b:2": 1}
        assert held(index, ["a:1", "b:2", "c:3"]) == {"a:1": 4, "b:2": 1, "c:3": 0}
        r = redis.Redis(port=srv.port)
        assert r.get(ik.pod_seq_key("a:1")) == b"0"
        assert r.hget(ik.pod_meta_key("a:1"), "block_size") == b"4"
        # An evicted middle block cuts the run there.
        a.pub.publish([BlockRemoved(block_hashes=[a.h(2)], medium="GPU")])
        wait_for(lambda: feeder.batches >= 3)
        assert hits(index, TOKENS, ["a:1", "b:2"]) == {"a:1": 2, "b:2": 1}
        assert held(index, ["a:1", "b:2"]) == {"a:1": 3, "b:2": 1}
        a.pub.publish([AllBlocksCleared()])
        wait_for(lambda: feeder.batches >= 4)
        assert hits(index, TOKENS, ["a:1", "b:2"]) == {"b:2": 1}
        assert held(index, ["a:1", "b:2"]) == {"a:1": 0, "b:2": 1}
        assert r.scard(ik.pod_keys_key("a:1")) == 0
        feeder.remove("b:2")
        wait_for(lambda: "b:2" not in feeder.pods())
        assert hits(index, TOKENS, ["a:1", "b:2"]) == {}
        assert not r.exists(ik.pod_keys_key("b:2"))
    finally:
        feeder.stop()
        a.pub.close()
        b.pub.close()


def test_restarted_gateway_catches_up_by_replay(srv):
    a = Engine("a:1", 1)
    index = make_index(srv.port)
    feeder = EventFeeder(index)
    feeder.start()
    a.pub.publish([stored([a.h(0), a.h(1)], None, TOKENS[:8])])
    feeder.add(a.source())  # after: the replay from seq 0 delivers it (no slow joiner)
    wait_for(lambda: feeder.batches >= 1)
    feeder.stop()  # gateway goes away; the engine keeps caching
    a.pub.publish([stored([a.h(2)], a.h(1), TOKENS[8:12])])
    a.pub.publish([stored([a.h(3), a.h(4)], a.h(2), TOKENS[12:20])])
    time.sleep(0.2)
    index2 = make_index(srv.port)  # fresh process state, same Redis
    feeder2 = EventFeeder(index2)
    feeder2.start()
    try:
        feeder2.add(a.source())
        wait_for(lambda: feeder2.batches >= 2)
        assert hits(index2, TOKENS, ["a:1"]) == {"a:1": 5}
        # the local view was warmed from Redis plus the replayed batches
        assert index2.local.lookup(request_keys(MODEL, BS, TOKENS), ["a:1"], 0) == {"a:1": 5}
        # a new block chained on a parent the new gateway only knows from Redis
        a.pub.publish([stored([a.h(5)], a.h(4), TOKENS[20:24])])
        wait_for(lambda: feeder2.batches >= 3)
        assert hits(index2, TOKENS, ["a:1"]) == {"a:1": 6}
    finally:
        feeder2.stop()
        a.pub.close()


def test_redis_outage_falls_back_and_resyncs(srv):
    a = Engine("a:1", 1)
    index = make_index(srv.port)
    modes = []
    index.on_mode_change.append(modes.append)
    feeder = EventFeeder(index, recover_every_s=0.1)
    feeder.start()
    try:
        a.pub.publish([stored([a.h(0)], None, TOKENS[:4])])
        feeder.add(a.source())
        wait_for(lambda: feeder.batches >= 1)
        assert index.mode == "redis"
        srv.stop()
        a.pub.publish([stored([a.h(1), a.h(2)], a.h(0), TOKENS[4:12])])
        wait_for(lambda: feeder.batches >= 2)
        assert hits(index, TOKENS, ["a:1"]) == {"a:1": 3}  # served from the local view
        assert index.mode == "local"
        srv.start()  # empty Redis on the same port
        wait_for(lambda: index.mode == "redis")
        assert modes == ["local", "redis"]
        r = redis.Redis(port=srv.port)
        assert r.scard(ik.pod_keys_key("a:1")) == 3
        assert r.get(ik.pod_seq_key("a:1")) == b"1"
        a.pub.publish([stored([a.h(3)], a.h(2), TOKENS[12:16])])
        wait_for(lambda: feeder.batches >= 3)
        assert hits(index, TOKENS, ["a:1"]) == {"a:1": 4}
    finally:
        feeder.stop()
        a.pub.close()


def test_engine_restart_drops_old_entries():
    a = Engine("a:1", 1)
    index = make_index(None)
    feeder = EventFeeder(index)
    feeder.start()
    try:
        for i in range(3):
            a.pub.publish([stored([a.h(i)], a.h(i - 1) if i else None, TOKENS[4 * i:4 * i + 4])])
        feeder.add(a.source())
        wait_for(lambda: feeder.batches >= 3)
        assert hits(index, TOKENS, ["a:1"]) == {"a:1": 3}
        endpoint = a.source()
        a.pub.close()
        # same endpoints, a new process: seq restarts at 0, different hashes
        pub2 = restarted_publisher(endpoint)
        pub2.publish([stored([77], None, TOKENS[:4])])
        publish_until(pub2, lambda: feeder.restarts == 1)
        wait_for(lambda: hits(index, TOKENS, ["a:1"]) == {"a:1": 1})
        assert feeder.errors == 0
        pub2.close()
    finally:
        feeder.stop()


def test_speculative_entries_expire(srv):
    index = make_index(srv.port)
    keys = request_keys(MODEL, BS, TOKENS)

    async def go():
        index.speculate("a:1", keys[:3], ttl_ms=1500)
        await eventually(lambda: spec_entries(index, "a:1") == 3, what="sent to Redis")
        index.local.clear("a:1")  # only Redis may answer now
        h1 = (await index.lookup(keys, ["a:1", "b:2"]))[0]

        async def expired():
            return (await index.lookup(keys, ["a:1", "b:2"]))[0] == {}

        await eventually(expired, timeout=5.0, what="expired after its 1.5 s TTL")
        return h1

    assert LOOP.run_until_complete(go()) == {"a:1": 3}


def test_a_shorter_speculation_never_cuts_a_longer_one_short(srv):
    """Replicas with other TTLs decide for one pod: the longest expiry counts, in
    Redis (entry and key) and in a view."""
    index, other = make_index(srv.port), make_index(srv.port)
    keys = request_keys(MODEL, BS, TOKENS)

    async def go():
        index.speculate("a:1", keys[:3], ttl_ms=60_000)
        await eventually(lambda: spec_entries(index, "a:1") == 3, what="flushed")
        other.speculate("a:1", keys[:3], ttl_ms=300)
        await asyncio.sleep(other.flush_after_s + 0.5)  # past the short TTL
        index.local.clear("a:1")  # Redis answers
        return (await index.lookup(keys, ["a:1"])).hits

    assert LOOP.run_until_complete(go()) == {"a:1": 3}
    assert index.redis.sync.pttl(ik.pod_spec_key("a:1")) > 50_000
    view = LocalIndex()
    view.add_speculative("a:1", keys[:1], 2e12)
    view.add_speculative("a:1", keys[:1], 1e12)
    assert view.lookup(keys, ["a:1"], 1.5e12) == {"a:1": 1}


def test_a_clock_running_ahead_cannot_make_a_speculation_outlive_its_ttl(srv):
    """Expiries only grow in Redis (ZADD GT), so one written an hour ahead by a
    replica whose clock runs ahead is capped at Redis's time + the TTL, and so is
    the expiry published to the other replicas' mirrors."""
    index = make_index(srv.port)
    keys = request_keys(MODEL, BS, TOKENS)
    r = redis.Redis(port=srv.port)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(ik.SPEC_CHANNEL)
    index.redis.speculate_later("a:1", keys[:2], 1_000, time.time() * 1000 + 3_600_000)
    LOOP.run_until_complete(index.redis.flush())
    secs, micros = r.time()
    redis_now = secs * 1000 + micros / 1000
    scores = [s for _, s in r.zrange(ik.pod_spec_key("a:1"), 0, -1, withscores=True)]
    assert len(scores) == 2 and all(redis_now < s <= redis_now + 1_000 for s in scores)
    msg = None
    for _ in range(50):  # (the subscription's confirmation is read as None first)
        if (msg := pubsub.get_message(timeout=0.1)) is not None:
            break
    assert msg is not None and float(msg["data"].split(b"\n")[2]) == scores[0]
    pubsub.close()


def test_a_speculation_without_a_lookup_after_it_is_flushed_alone(srv):
    index = make_index(srv.port)
    keys = request_keys(MODEL, BS, TOKENS)
    spec_key = ik.pod_spec_key("a:1")

    async def go():
        index.speculate("a:1", keys[:2], ttl_ms=60_000)
        queued = index.redis.sync.zcard(spec_key)
        await eventually(lambda: index.redis.sync.zcard(spec_key) == 2, what="flushed alone")
        return queued, index.redis.sync.zcard(spec_key), index.redis.pending

    assert LOOP.run_until_complete(go()) == (0, 2, 0)


def test_own_speculations_count_before_they_reach_redis(srv):
    """A replica's latest decisions extend Redis's hits before they are flushed."""
    index, other = make_index(srv.port), make_index(srv.port)  # two gateway replicas
    keys = request_keys(MODEL, BS, TOKENS)

    async def go():
        other.speculate("b:2", keys[:2], ttl_ms=60_000)
        await eventually(lambda: spec_entries(other, "b:2") == 2, what="in Redis")
        index.speculate("b:2", keys[2:], ttl_ms=60_000)  # continues b's run
        index.speculate("a:1", keys[:1], ttl_ms=60_000)
        assert index.redis.pending == 2  # none flushed yet
        mine = (await index.lookup(keys, ["a:1", "b:2", "c:3"])).hits
        theirs = (await other.lookup(keys, ["a:1", "b:2", "c:3"])).hits
        return mine, theirs

    assert LOOP.run_until_complete(go()) == ({"a:1": 1, "b:2": len(keys)}, {"b:2": 2})


def test_a_burst_of_one_prefix_sticks_with_redis_up(srv):
    """Concurrent and back-to-back routings of one prompt, all within the
    speculative flush interval, go to the first one's pod as hits."""
    from routing_testing import Pods, make_router

    from sluice.gateway.load.table import EngineMetrics, LoadTable

    pods = ["p0:1", "p1:1", "p2:1", "p3:1"]
    index = make_index(srv.port)
    index.flush_after_s = 60.0  # nothing reaches Redis during the test
    table = LoadTable(ttl_ms=60_000)
    for pod in pods:
        table.put(pod, EngineMetrics(waiting=0, running=0, kv_usage=0.1), time.time() * 1000)
    router = make_router("kv_aware", index, table,
                         Pods(default_block_size=BS))
    tokens = list(range(500, 541))  # 10 full blocks and a token

    async def go():
        burst = await asyncio.gather(*[router.route(MODEL, tokens, pods) for _ in range(6)])
        after = [await router.route(MODEL, tokens, pods) for _ in range(3)]
        return [(d.pod, d.hit_blocks) for d in burst + after]

    decisions = LOOP.run_until_complete(go())
    assert {pod for pod, _ in decisions} == {decisions[0][0]}
    # (the burst's lookups go over several pooled connections: the first one
    # answered, not necessarily the first one sent, decides without hits)
    assert sorted(hit for _, hit in decisions[:6]) == [0] + [10] * 5
    assert [hit for _, hit in decisions[6:]] == [10] * 3


def test_bad_endpoint_does_not_stop_the_feed():
    a = Engine("a:1", 1)
    index = make_index(None)
    feeder = EventFeeder(index)
    feeder.start()
    try:
        feeder.add(EventSource("bad:1", MODEL, "no-transport:5557", "also-bad"))
        wait_for(lambda: feeder.errors >= 1)
        a.pub.publish([stored([a.h(0)], None, TOKENS[:4])])
        feeder.add(a.source())
        wait_for(lambda: hits(index, TOKENS, ["a:1"]) == {"a:1": 1})
        assert feeder.alive() and "bad:1" not in feeder.pods()
    finally:
        feeder.stop()
        a.pub.close()
    assert not feeder.alive()


def test_engine_restarted_while_the_gateway_was_away(srv):
    """Redis says seq 19 was applied; the engine restarted meanwhile and is at seq 1:
    its live batches are older by seq but newer by time, so its old entries go.
    (Once a restarted engine's seq passes the stored one, nothing tells it apart.)"""
    a = Engine("away:1", 1)
    index = make_index(srv.port)
    feeder = EventFeeder(index)
    feeder.start()
    for i in range(4):
        a.pub.publish([stored([a.h(i)], a.h(i - 1) if i else None, TOKENS[4 * i:4 * i + 4])])
    for _ in range(16):
        a.pub.publish([BlockRemoved(block_hashes=[987654321], medium="GPU")])
    feeder.add(a.source())
    wait_for(lambda: feeder.batches >= 20)
    feeder.stop()
    endpoint = a.source()
    a.pub.close()
    pub2 = restarted_publisher(endpoint)
    pub2.publish([stored([90], None, TOKENS[:4])])        # seq 0
    pub2.publish([stored([91], 90, TOKENS[4:8])])         # seq 1
    index2 = make_index(srv.port)
    feeder2 = EventFeeder(index2)
    feeder2.start()
    try:
        feeder2.add(endpoint)
        wait_for(lambda: hits(index2, TOKENS, ["away:1"]) == {"away:1": 4})  # stale, from Redis
        wait_for(lambda: [s.last_seq for s in feeder2._pods.values()] == [19])
        pub2.publish([stored([92], 91, TOKENS[8:12])])    # seq 2 < 19
        publish_until(pub2, lambda: feeder2.restarts == 1)  # (if seq 2 came too early)
        wait_for(lambda: hits(index2, TOKENS, ["away:1"]) == {"away:1": 3})
        assert index2.local.lookup(request_keys(MODEL, BS, TOKENS), ["away:1"], 0) == {
            "away:1": 3}
    finally:
        feeder2.stop()
        pub2.close()


def test_pod_removed_during_an_outage_is_purged_on_recovery(srv):
    a = Engine("gone:1", 1)
    index = make_index(srv.port)
    feeder = EventFeeder(index, recover_every_s=0.1)
    feeder.start()
    r = redis.Redis(port=srv.port)
    try:
        a.pub.publish([stored([a.h(0)], None, TOKENS[:4])])
        feeder.add(a.source())
        wait_for(lambda: feeder.batches >= 1)
        assert r.scard(ik.pod_keys_key("gone:1")) == 1
        srv.pause()
        a.pub.publish([stored([a.h(1)], a.h(0), TOKENS[4:8])])
        wait_for(lambda: index.mode == "local")
        feeder.remove("gone:1")
        wait_for(lambda: "gone:1" not in feeder.pods())
        srv.resume()
        wait_for(lambda: index.mode == "redis")
        assert not r.exists(ik.pod_keys_key("gone:1")) and not r.exists(ik.pod_seq_key("gone:1"))
        assert not r.exists(ik.block_key(request_keys(MODEL, BS, TOKENS)[0]))
    finally:
        feeder.stop()
        a.pub.close()


def test_a_batch_seen_twice_after_warming_from_redis_is_no_restart(srv):
    """Replica B reads pod X's position (seq 3, its ts) from Redis while batch 3 still
    waits in its socket: that duplicate must not be taken for a restart (which would
    purge X for every replica); a batch with seq back and a newer ts is one."""
    from sluice.gateway.events.sockets import PodState
    from sluice.kv_events import KVEventBatch, encode_batch

    def batch(ts, events):
        return encode_batch(KVEventBatch(ts=ts, events=events, data_parallel_rank=0))

    index_a = make_index(srv.port)
    for i in range(4):
        index_a.apply("x:1", i, [(f"e{i}", request_keys(MODEL, BS, TOKENS)[i])], [], False, BS,
                      ts=100.0 + i)
    index_b = make_index(srv.port)
    feeder = EventFeeder(index_b)  # not started: its handlers are driven by hand
    state = PodState(EventSource("x:1", MODEL, "tcp://127.0.0.1:1", None), None, None)
    feeder._catch_up_new(state)
    assert (state.last_seq, state.last_ts) == (3, 103.0)
    feeder._on_live(state, [b"t", (3).to_bytes(8, "big"), batch(103.0, [])])
    feeder._on_live(state, [b"t", (2).to_bytes(8, "big"), batch(102.0, [])])
    assert feeder.restarts == 0 and hits(index_b, TOKENS, ["x:1"]) == {"x:1": 4}
    feeder._on_live(state, [b"t", (0).to_bytes(8, "big"), batch(200.0, [
        stored([1], None, TOKENS[:4])])])
    assert feeder.restarts == 1 and hits(index_b, TOKENS, ["x:1"]) == {"x:1": 1}
    r = redis.Redis(port=srv.port)
    assert r.get(ik.pod_seq_key("x:1")) == b"0" and float(r.get(ik.pod_ts_key("x:1"))) == 200
    # a batch that cannot be translated is skipped once (counted), not replayed forever
    bad = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[2**63 + 1] * 4,
                      block_size=BS, lora_id=None, medium="GPU", lora_name=None)
    feeder._on_live(state, [b"t", (1).to_bytes(8, "big"), batch(201.0, [bad])])
    assert state.last_seq == 1 and feeder.errors == 1


def test_one_feeder_subscribes_to_hundreds_of_pods():
    """A pod takes up to 4 ZMQ sockets (SUB, replay DEALER, the SUB's monitor pair):
    past ZMQ's default cap of 1023 per context, every pod still gets its own."""
    a = Engine("a:1", 1)
    endpoint = a.source().endpoint
    feeder = EventFeeder(make_index(None))
    feeder.start()
    try:
        for i in range(400):  # 3 sockets each (no replay endpoint: no 50 ms replays)
            feeder.add(EventSource(f"p{i}:1", MODEL, endpoint, None))
        wait_for(lambda: len(feeder.pods()) == 400, timeout=20)
        assert feeder.errors == 0
        assert all(s.watch is not None for s in list(feeder._pods.values()))
    finally:
        feeder.stop()
        a.pub.close()


def test_batches_missed_before_the_first_live_one_are_replayed():
    """A new pod whose catch-up replay found nothing, then whose first live batch is
    not seq 0 (batches sent before the subscription went live were dropped by the
    PUB socket): the missed ones are replayed, not lost."""
    from sluice.gateway.events.sockets import PodState
    from sluice.kv_events import KVEventBatch, encode_batch

    a = Engine("a:1", 1)
    index = make_index(None)
    feeder = EventFeeder(index)  # not started: its live path is driven by hand
    b0 = [stored([a.h(0), a.h(1)], None, TOKENS[:8])]
    b1 = [stored([a.h(2)], a.h(1), TOKENS[8:12])]
    a.pub.publish(b0)  # no subscriber yet: dropped live, kept for replay
    a.pub.publish(b1)
    wait_for(lambda: len(a.pub._buffer) == 2)
    source = a.source()
    state = PodState(source, feeder._ctx.socket(zmq.SUB), feeder._replay_socket(source))
    try:
        assert state.last_seq == -1  # what an empty catch-up leaves
        payload = encode_batch(KVEventBatch(ts=time.time(), events=b1, data_parallel_rank=0))
        feeder._on_live(state, [b"kv", (1).to_bytes(8, "big"), payload])
        assert state.last_seq == 1
        assert hits(index, TOKENS, ["a:1"]) == {"a:1": 3}
    finally:
        state.close()
        a.pub.close()


def restart_after_one_batch(srv, new_engine):
    """An engine publishes batch 0, which the feeder applies, then restarts on the
    same endpoints; `new_engine(pub)` publishes the new incarnation's batches.
    The feeder must drop the old entries, not stack the new engine's onto them."""
    a = Engine("a:1", 1)
    src = a.source()
    index = make_index(srv.port)
    feeder = EventFeeder(index)
    feeder.start()
    pub2 = None
    try:
        a.pub.publish([stored([a.h(0), a.h(1)], None, TOKENS[:8])])  # seq 0
        feeder.add(src)
        wait_for(lambda: feeder.batches >= 1)
        a.pub.close()
        pub2 = restarted_publisher(src)
        new_engine(pub2, feeder)
        assert feeder.restarts == 1
        assert hits(index, TOKENS[:8], ["a:1"]) == {}
        assert hits(index, [9, 9, 9, 9, 8, 8, 8, 8], ["a:1"]) == {"a:1": 2}
    finally:
        feeder.stop()
        for p in (a.pub, pub2):
            if p is not None:
                p.close()


def test_restart_seen_first_past_the_last_seq_is_detected(srv):
    """The first batch seen of the new engine is already past the last seq applied
    (its first ones went out before the SUB reconnected): the catch-up compares
    the batch at the last seq and sees another timestamp."""
    def new_engine(pub, feeder):
        pub.publish([stored([2000], None, [9, 9, 9, 9])])  # seq 0, 1: likely sent
        pub.publish([stored([2001], 2000, [8, 8, 8, 8])])  # before the SUB reconnects
        time.sleep(1.0)
        publish_until(pub, lambda: feeder.batches >= 3)

    restart_after_one_batch(srv, new_engine)


def test_restart_seen_first_right_after_the_last_seq_is_detected(srv):
    """The new engine's seq 0 goes out before the SUB reconnects and seq 1 is the
    first one seen, right after the old engine's last applied seq 0. The dropped
    connection makes the feeder compare batch 0 by replay first."""
    def new_engine(pub, feeder):
        pub.publish([stored([2000], None, [9, 9, 9, 9])])  # seq 0: before the reconnect
        time.sleep(1.0)  # reconnected
        pub.publish([stored([2001], 2000, [8, 8, 8, 8])])  # seq 1, seen live
        wait_for(lambda: feeder.batches >= 3)  # old 0, then new 0 and 1 (replayed)

    restart_after_one_batch(srv, new_engine)


def test_old_batches_read_after_the_drop_do_not_use_up_the_restart_check():
    """The SUB dropped with the old engine's last batch still queued: read first,
    it is compared against the new engine, which has no batch at the last seq
    yet -- nothing settled. The new engine's batch that happens to follow by seq
    is compared again, and the restart is seen."""
    a = Engine("a:1", 1)
    src = a.source()
    index = make_index(None)
    feeder = EventFeeder(index)  # not started: its live path is driven by hand
    state = PodState(src, feeder._ctx.socket(zmq.SUB), feeder._replay_socket(src))
    pub2 = None

    def frames(seq, ts, events):
        payload = encode_batch(KVEventBatch(ts=ts, events=events, data_parallel_rank=0))
        return [b"t", seq.to_bytes(8, "big"), payload]
    try:
        feeder._on_live(state, frames(0, 100.0, [stored([a.h(0)], None, TOKENS[:4])]))
        a.pub.close()
        pub2 = restarted_publisher(src)
        state.reconnected = True  # (what the connection watch reports)
        feeder._on_live(state, frames(1, 101.0, [stored([a.h(1)], a.h(0), TOKENS[4:8])]))
        assert state.last_seq == 1 and state.reconnected and feeder.restarts == 0
        for tokens in ([9, 9, 9, 9], [8, 8, 8, 8], [7, 7, 7, 7]):  # new engine: seq 0..2
            pub2.publish([stored([tokens[0]], None, tokens)])
        wait_for(lambda: len(pub2._buffer) == 3)
        seq, payload = pub2._buffer[2]
        feeder._on_live(state, [b"t", seq.to_bytes(8, "big"), payload])
        assert feeder.restarts == 1 and not state.reconnected and state.last_seq == 2
        assert hits(index, TOKENS[:8], ["a:1"]) == {}
        assert hits(index, [9, 9, 9, 9], ["a:1"]) == {"a:1": 1}
    finally:
        state.close()
        for p in (a.pub, pub2):
            if p is not None:
                p.close()


def test_gateway_restart_after_an_engine_restart_past_the_stored_seq(srv):
    """Gateway down while its engine restarted and published past the seq stored in
    Redis: warming from Redis, then the catch-up finds another batch at that seq."""
    a = Engine("a:1", 1)
    src = a.source()
    feeder = EventFeeder(make_index(srv.port))
    feeder.start()
    a.pub.publish([stored([a.h(0), a.h(1)], None, TOKENS[:8])])  # seq 0 (old engine)
    feeder.add(src)
    wait_for(lambda: feeder.batches >= 1)
    feeder.stop()
    a.pub.close()
    pub2 = restarted_publisher(src)
    pub2.publish([BlockRemoved(block_hashes=[1], medium="GPU")])  # seq 0
    pub2.publish([stored([2000], None, [9, 9, 9, 9])])  # seq 1
    pub2.publish([stored([2001], 2000, [8, 8, 8, 8])])  # seq 2
    wait_for(lambda: len(pub2._buffer) == 3)
    index = make_index(srv.port)
    feeder = EventFeeder(index)
    feeder.start()
    try:
        feeder.add(src)
        wait_for(lambda: feeder.restarts == 1 and feeder.batches >= 3)
        assert hits(index, TOKENS[:8], ["a:1"]) == {}
        assert hits(index, [9, 9, 9, 9, 8, 8, 8, 8], ["a:1"]) == {"a:1": 2}
    finally:
        feeder.stop()
        pub2.close()


def test_lookups_that_redis_does_not_answer_in_time_use_the_local_view(srv):
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(f"redis://127.0.0.1:{srv.port}/0",
                                                          0.5), lookup_timeout_s=0.1)
    keys = request_keys(MODEL, BS, TOKENS)
    index.apply("p:1", 0, [(f"e{i}", keys[i]) for i in range(2)], [], False, BS, ts=1.0)
    assert hits(index, TOKENS, ["p:1"]) == {"p:1": 2}
    srv.pause()  # Redis stops answering, its connection stays open
    try:
        for _ in range(PrefixIndex.MAX_SLOW_LOOKUPS):
            assert index.mode == "redis", "a few slow answers are no outage"
            t0 = time.monotonic()
            assert hits(index, TOKENS, ["p:1"]) == {"p:1": 2}  # the local view's answer
            assert time.monotonic() - t0 < 0.4, "bounded by lookup_timeout_s"
        assert index.mode == "local"
    finally:
        srv.resume()


def test_a_redis_that_lost_its_data_is_noticed_and_re_synced_while_idle(srv):
    """Redis restarted empty and no batch comes: the feeder's epoch check finds the
    loss and the replica rewrites the pod from its view."""
    a = Engine("a:1", 1)
    index = make_index(srv.port)
    feeder = EventFeeder(index)
    feeder.start()
    r = redis.Redis(port=srv.port)
    try:
        feeder.add(a.source())
        publish_until(a.pub, lambda: feeder.batches >= 1)
        a.pub.publish([stored([a.h(0), a.h(1)], None, TOKENS[:8])])
        wait_for(lambda: r.scard(ik.pod_keys_key("a:1")) == 2)
        r.flushdb()
        wait_for(lambda: r.scard(ik.pod_keys_key("a:1")) == 2 and index.mode == "redis")
        assert hits(index, TOKENS, ["a:1"]) == {"a:1": 2}
        a.pub.publish([stored([a.h(2)], a.h(1), TOKENS[8:12])])  # fed on top, as before
        wait_for(lambda: r.scard(ik.pod_keys_key("a:1")) == 3)
    finally:
        feeder.stop()
        a.pub.close()


def test_a_replica_noticing_the_loss_after_another_rewrote_keeps_its_work(srv):
    keys = request_keys(MODEL, BS, TOKENS)
    first, second = make_index(srv.port), make_index(srv.port)
    pairs = [(f"e{i}", k) for i, k in enumerate(keys[:3])]
    for index in (first, second):
        index.apply("a:1", 0, pairs, [], False, BS, ts=5.0)
    r = redis.Redis(port=srv.port)
    r.flushdb()
    first.check_epoch()
    assert first.mode == "local" and first.recover() and first.mode == "redis"
    assert r.scard(ik.pod_keys_key("a:1")) == 3
    second.apply("a:1", 1, [("e3", keys[3])], [], False, BS, ts=6.0)  # LOST: not applied
    assert second.mode == "local" and r.get(ik.pod_seq_key("a:1")) == b"0"
    assert second.recover() and r.scard(ik.pod_keys_key("a:1")) == 4


def test_a_re_sync_keeps_every_replicas_speculative_entries(srv):
    keys = request_keys(MODEL, BS, TOKENS)
    rewriter, other = make_index(srv.port), make_index(srv.port)
    rewriter.apply("a:1", 0, [("e0", keys[0])], [], False, BS, ts=5.0)

    async def go():
        other.speculate("a:1", keys, ttl_ms=60_000)
        await eventually(lambda: spec_entries(other, "a:1") == len(keys), what="flushed")

    LOOP.run_until_complete(go())
    redis.Redis(port=srv.port).delete(ik.pod_seq_key("a:1"))  # so the re-sync is due
    assert rewriter.redis.resync("a:1", 0, 5.0, rewriter.local.snapshot("a:1"), BS)
    other.local.clear("a:1")  # only Redis may answer now
    assert hits(other, TOKENS, ["a:1"]) == {"a:1": len(keys)}


def test_a_partial_view_is_merged_into_redis_not_written_over_it(srv):
    """A replica whose warm-up from Redis failed feeds on from a later batch: its view
    lacks the pod's earlier entries, so its re-sync adds to Redis's."""
    keys = request_keys(MODEL, BS, TOKENS)
    fed = make_index(srv.port)
    for i in range(3):
        fed.apply("a:1", i, [(f"e{i}", keys[i])], [], False, BS, ts=5.0 + i)
    late = make_index(srv.port)
    feeder = EventFeeder(late)
    state = PodState(EventSource("a:1", MODEL, "tcp://127.0.0.1:1", None), None, None)

    def fails(pod):
        raise redis.exceptions.TimeoutError("slow")

    late.redis.load_hashes = fails
    feeder._catch_up_new(state)  # position read, entries not: replays from 0 (none here)
    assert late.mode == "local" and state.last_seq == -1
    batch = KVEventBatch(ts=8.0, events=[stored([103], None, TOKENS[12:16])])
    feeder._on_live(state, [b"t", (3).to_bytes(8, "big"), encode_batch(batch)])
    assert late.recover()
    r = redis.Redis(port=srv.port)
    assert r.scard(ik.pod_keys_key("a:1")) == 4 and r.get(ik.pod_seq_key("a:1")) == b"3"


def test_a_skipped_batch_is_no_engine_restart():
    a = Engine("a:1", 1)
    index = make_index(None)
    feeder = EventFeeder(index)
    state = PodState(a.source(), None, feeder._replay_socket(a.source()))
    try:
        a.pub.publish([stored([a.h(0)], None, TOKENS[:4])])
        a.pub.publish([stored([a.h(1)], a.h(0), TOKENS[4:8])])
        a.pub.publish([stored([a.h(9)], None, [7] * 4, bs=0)])  # untranslatable
        wait_for(lambda: (feeder._catch_up(state), state.last_seq)[1] == 2)
        a.pub.publish([stored([a.h(2)], a.h(1), TOKENS[8:12])])  # seq 3: missed live
        last = KVEventBatch(ts=time.time(), events=[stored([a.h(3)], a.h(2), TOKENS[12:16])])
        a.pub.publish(last.events)
        time.sleep(0.1)
        feeder._on_live(state, [b"t", (4).to_bytes(8, "big"), encode_batch(last)])  # a gap
        assert feeder.restarts == 0 and index.local.lookup(
            request_keys(MODEL, BS, TOKENS), ["a:1"], 0) == {"a:1": 4}
    finally:
        a.pub.close()


def test_local_reads_route_on_the_replicas_view_and_still_write_redis(srv):
    keys = request_keys(MODEL, BS, TOKENS)
    other = make_index(srv.port)
    other.apply("b:2", 0, [(f"e{i}", k) for i, k in enumerate(keys[:3])], [], False, BS, 5.0)
    reader = PrefixIndex(LocalIndex(), RedisIndex.from_url(srv.url, 0.5), read_local=True)
    reader.apply("a:1", 0, [("e0", keys[0]), ("e1", keys[1])], [], False, BS, 5.0)
    found = LOOP.run_until_complete(reader.lookup(keys, ["a:1", "b:2"]))
    assert found.hits == {"a:1": 2} and found.loads is None  # b:2 is only in Redis
    assert reader.mode == "redis"
    assert redis.Redis(port=srv.port).scard(ik.pod_keys_key("a:1")) == 2
