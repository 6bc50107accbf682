"""Several gateway replicas writing one pod's entries to one Redis: a replica
re-syncing after an outage, and replicas detecting the same engine restart, never
lose what another replica applied."""

import asyncio
import time

import pytest
import redis
from redis_server import RedisServer

from sluice import index_keys as ik
from sluice.gateway.events.feed import EventFeeder
from sluice.gateway.events.sockets import EventSource, PodState
from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.index.redis_apply import encode_ops
from sluice.gateway.index.redis_index import RedisIndex, async_client
from sluice.gateway.prompt.block_keys import request_keys
from sluice.kv_events import BlockStored, KVEventBatch, encode_batch

POD = "x:1"
BS = 4
MODEL = "m"


@pytest.fixture
def srv():
    with RedisServer() as s:
        yield s


def key(i: int) -> str:
    return f"{i + 1:016x}"


def one_store(i: int) -> bytes:
    return encode_ops([(f"e{i}", key(i))], [], False, BS)


class AfterBigWrite(redis.Redis):
    """A client that runs `hook` once, right after its first script call carrying a
    large argument (a re-sync's first chunk of entries): another replica acting
    in the middle of a re-sync."""

    hook = None

    def evalsha(self, sha, numkeys, *args):
        out = super().evalsha(sha, numkeys, *args)
        if self.hook is not None and any(isinstance(a, bytes) and len(a) > 50_000
                                         for a in args):
            hook, self.hook = self.hook, None
            hook()
        return out


def held(r: redis.Redis) -> set[str]:
    return {x.decode() for x in r.smembers(ik.pod_keys_key(POD))}


def test_resync_leaves_a_pod_that_redis_holds_further_alone(srv):
    """Replica B never lost Redis and applied the pod's batches 0..6; replica A comes
    back from an outage at batch 5: rewriting Redis from its view would drop batch 6."""
    url = f"redis://127.0.0.1:{srv.port}/0"
    a, b = RedisIndex.from_url(url, 1.0), RedisIndex.from_url(url, 1.0)
    for i in range(7):
        assert b.apply(POD, i, one_store(i), ts=100.0 + i)
    a.resync(POD, 5, 105.0, {f"e{i}": key(i) for i in range(6)}, BS)
    r = redis.Redis(port=srv.port)
    assert held(r) == {key(i) for i in range(7)}
    assert r.get(ik.pod_seq_key(POD)) == b"6"


def test_a_pod_being_rewritten_has_no_position_to_warm_from(srv):
    r = redis.Redis(port=srv.port)
    index = RedisIndex.from_url(f"redis://127.0.0.1:{srv.port}/0", 1.0)
    assert index.apply(POD, 4, one_store(4), ts=104.0)
    assert index.stored_position(POD) == (4, 104.0)
    r.hset(ik.pod_sync_key(POD), mapping={"owner": "other", "until": time.time() * 1e3 + 1e4})
    assert index.stored_position(POD) is None  # half rewritten: replay, don't warm


@pytest.mark.parametrize("stored, rewritten", [
    ((6, 106.0), False),  # another replica applied further
    ((5, 105.0), False),  # as far
    ((3, 103.0), True),   # not as far
    ((9, 90.0), True),    # an older engine incarnation's batches
    ((1, 300.0), False),  # a newer one's (this replica has yet to see the restart)
])
def test_resync_only_when_redis_is_behind(srv, stored, rewritten):
    index = RedisIndex.from_url(f"redis://127.0.0.1:{srv.port}/0", 1.0)
    assert index.apply(POD, stored[0], one_store(9), ts=stored[1])
    assert index.resync(POD, 5, 105.0, {"e0": key(0)}, BS) == rewritten
    r = redis.Redis(port=srv.port)
    assert held(r) == ({key(0)} if rewritten else {key(9)})
    assert r.get(ik.pod_seq_key(POD)) == (b"5" if rewritten else str(stored[0]).encode())


def test_batches_of_other_replicas_wait_for_a_resync_to_end(srv):
    """Redis holds the pod at batch 3; replica A re-syncs it at batch 5 (its view has
    12k entries: several chunks). Mid-way, replica B applies batches 4, 5 and 6,
    which evicts e1. A then applies batch 6 itself: e1 must be gone, not written back
    by A's later chunks with B's removal refused to A as already applied."""
    url = f"redis://127.0.0.1:{srv.port}/0"
    b = RedisIndex.from_url(url, 1.0)
    a_client = AfterBigWrite(port=srv.port)
    a = RedisIndex(a_client, async_client(url, 1.0))
    filler = {f"f{j}": f"{j + 100:016x}" for j in range(12_000)}
    for i in range(4):
        assert b.apply(POD, i, encode_ops([*(filler.items() if i == 0 else []),
                                           (f"e{i}", key(i))], [], False, BS), ts=100.0 + i)
    evict_e1 = encode_ops([], ["e1"], False)

    def b_applies_4_to_6():
        assert not b.resync(POD, 5, 105.0, {}, BS)  # A rewrites the pod: B leaves it be
        for i in (4, 5):
            b.apply(POD, i, one_store(i), ts=100.0 + i)
        b.apply(POD, 6, evict_e1, ts=106.0)

    a_client.hook = b_applies_4_to_6
    view = {**filler, **{f"e{i}": key(i) for i in (0, 2, 3, 4, 5)}, "e1": key(1)}  # e1 last
    a.resync(POD, 5, 105.0, view, BS)
    assert a_client.hook is None  # B did act mid-way
    a.apply(POD, 6, evict_e1, ts=106.0)  # A's feed goes on after its re-sync
    r = redis.Redis(port=srv.port)
    assert held(r) == set(filler.values()) | {key(i) for i in (0, 2, 3, 4, 5)}
    assert r.get(ik.pod_seq_key(POD)) == b"6"
    assert not b.apply(POD, 6, evict_e1, ts=106.0)  # applied once


def test_a_rewrite_abandoned_half_way_is_taken_over(srv, monkeypatch):
    """Replica A dies in the middle of a re-sync: B's batches are refused while A's
    lease lasts (on Redis's clock: B's own clock may be far ahead), then B rewrites
    the pod from its own view."""
    url = f"redis://127.0.0.1:{srv.port}/0"
    b = PrefixIndex(LocalIndex(), RedisIndex.from_url(url, 1.0))
    for i in range(4):
        b.apply(POD, i, [(f"e{i}", key(i))], [], False, BS, ts=100.0 + i)
    a_client = AfterBigWrite(port=srv.port)
    a = RedisIndex(a_client, async_client(url, 1.0), lease_ms=300)

    def dies():
        raise RuntimeError("replica A is gone")

    a_client.hook = dies
    with pytest.raises(RuntimeError):
        a.resync(POD, 5, 105.0, {f"f{j}": f"{j + 100:016x}" for j in range(12_000)}, BS)
    r = redis.Redis(port=srv.port)
    assert r.exists(ik.pod_sync_key(POD)) and 0 < r.scard(ik.pod_keys_key(POD)) < 12_000
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # B's clock: 1 h ahead
    b.apply(POD, 4, [("e4", key(4))], [], False, BS, ts=104.0)  # fenced: refused
    monkeypatch.undo()
    assert r.get(ik.pod_seq_key(POD)) == b"3" and r.exists(ik.pod_sync_key(POD))
    time.sleep(0.35)
    b.apply(POD, 5, [("e5", key(5))], [], False, BS, ts=105.0)  # lapsed: B re-syncs
    assert held(r) == {key(i) for i in range(6)} and r.get(ik.pod_seq_key(POD)) == b"5"
    assert not r.exists(ik.pod_sync_key(POD)) and b.mode == "redis"


# -- engine restarts seen by two replicas ----------------------------------------------

OLD = list(range(500, 516))  # tokens the old engine cached (4 blocks)
NEW = list(range(700, 712))  # tokens the restarted engine caches (3 blocks)


def stored(hashes, parent, tokens):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None)


def frames(seq: int, ts: float, events) -> list[bytes]:
    payload = encode_batch(KVEventBatch(ts=ts, events=events, data_parallel_rank=0))
    return [b"kv", seq.to_bytes(8, "big"), payload]


def replica(port: int) -> tuple[EventFeeder, PodState]:
    """A gateway replica whose feeder is driven by hand (no sockets, no replay: an
    engine without a replay endpoint), warmed from Redis."""
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", 1.0))
    feeder = EventFeeder(index)
    state = PodState(EventSource(POD, MODEL, "tcp://127.0.0.1:1", None), None, None)
    feeder._catch_up_new(state)
    return feeder, state


def redis_hits(port: int, tokens: list[int]) -> dict[str, int]:
    index = RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", 1.0)

    async def lookup():
        try:
            return (await index.lookup(request_keys(MODEL, BS, tokens), [POD], 0))[0]
        finally:
            await index.aio.aclose()

    return asyncio.run(lookup())


def old_engine(port: int, last_seq: int) -> None:
    """The old engine's batches 0..last_seq (ts 100 + seq), applied by some replica."""
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", 1.0))
    feeder = EventFeeder(index)
    state = PodState(EventSource(POD, MODEL, "tcp://127.0.0.1:1", None), None, None)
    for i in range(last_seq + 1):
        feeder._on_live(state, frames(i, 100.0 + i, [
            stored([i + 1], i or None, OLD[4 * i:4 * i + 4])] if i < 4 else []))


NEW0 = (0, 200.0, [stored([1001], None, NEW[:4])])
NEW1 = (1, 201.0, [stored([1002], 1001, NEW[4:8])])
NEW2 = (2, 202.0, [stored([1003], 1002, NEW[8:12])])


def test_a_second_replica_seeing_the_same_restart_keeps_the_first_ones_rebuild(srv):
    """Replicas A and B both applied the old engine up to batch 3. It restarts: A sees
    its batches 0 and 1 and rebuilds the pod from them; B missed batch 0 and sees
    the restart at batch 1. B must not purge what A rebuilt."""
    old_engine(srv.port, 3)
    (fa, a), (fb, b) = replica(srv.port), replica(srv.port)
    fa._on_live(a, frames(*NEW0))
    fa._on_live(a, frames(*NEW1))
    assert fa.restarts == 1 and redis_hits(srv.port, NEW) == {POD: 2}
    fb._on_live(b, frames(*NEW1))
    assert fb.restarts == 1
    assert redis_hits(srv.port, OLD) == {} and redis_hits(srv.port, NEW) == {POD: 2}
    fa._on_live(a, frames(*NEW2))
    fb._on_live(b, frames(*NEW2))
    assert redis_hits(srv.port, NEW) == {POD: 3}


def test_an_engine_moved_to_another_event_endpoint_keeps_the_first_replicas_rebuild(srv):
    """The engine comes back restarted on another event endpoint (no replay). Replica A
    moves to it first and rebuilds the pod from its batches 0 and 1; B moves later and
    sees batch 1. The move keeps each replica's position, so B tells the restart by
    the batches and must not purge what A rebuilt."""
    import zmq

    old_engine(srv.port, 3)
    (fa, a), (fb, b) = replica(srv.port), replica(srv.port)
    moved = EventSource(POD, MODEL, "tcp://127.0.0.1:2", None)

    def move(feeder, state):
        poller = zmq.Poller()  # (the feeder thread's, with the old endpoint's socket)
        state.sub = feeder._connect(zmq.SUB, state.source, state.source.endpoint, "")
        poller.register(state.sub, zmq.POLLIN)
        feeder._pods[POD] = state
        feeder.move(moved)
        feeder._drain_commands(poller)
        state = feeder._pods[POD]
        assert state.source == moved and (state.last_seq, state.last_ts) == (3, 103.0)
        return state

    a2 = move(fa, a)
    assert redis_hits(srv.port, OLD) == {POD: 4}, "a move alone purges nothing"
    fa._on_live(a2, frames(*NEW0))
    fa._on_live(a2, frames(*NEW1))
    assert fa.restarts == 1 and redis_hits(srv.port, NEW) == {POD: 2}
    b2 = move(fb, b)
    fb._on_live(b2, frames(*NEW1))
    assert fb.restarts == 1
    assert redis_hits(srv.port, OLD) == {} and redis_hits(srv.port, NEW) == {POD: 2}
    for f in (fa, fb):
        f._pods.pop(POD).close()


def test_a_replica_behind_on_the_old_engine_still_purges_it(srv):
    """Replica B applied the old engine up to batch 2, another replica (gone since) up
    to batch 5: B seeing the restart first must still drop the old entries."""
    old_engine(srv.port, 2)
    fb, b = replica(srv.port)
    old_engine(srv.port, 5)  # (from 0: batches 0..2 are refused as applied)
    assert redis_hits(srv.port, OLD) == {POD: 4}
    fb._on_live(b, frames(*NEW0))
    assert fb.restarts == 1
    assert redis_hits(srv.port, OLD) == {} and redis_hits(srv.port, NEW) == {POD: 1}
    r = redis.Redis(port=srv.port)
    assert r.get(ik.pod_seq_key(POD)) == b"0"


def test_a_restart_seen_while_redis_was_down_is_purged_on_its_return(srv):
    """Replica A saw the restart during an outage and has not been fed since: on
    Redis's return it drops the old entries, unless another replica has meanwhile
    rebuilt the pod from the new incarnation."""
    from redis.exceptions import RedisError

    for rebuilt in (False, True):
        redis.Redis(port=srv.port).flushdb()
        old_engine(srv.port, 3)
        fa, a = replica(srv.port)
        fa.index._degrade(RedisError("outage"))
        fa.index.restarted(POD, a.last_ts, NEW0[:2])
        if rebuilt:
            fb, b = replica(srv.port)
            fb._on_live(b, frames(*NEW0))
        assert fa.index.recover()
        assert redis_hits(srv.port, OLD) == {}
        assert redis_hits(srv.port, NEW) == ({POD: 1} if rebuilt else {})


@pytest.mark.parametrize("stored, last_ts, seen, purged", [
    ((3, 103.0), 103.0, (0, 200.0), True),   # the old engine, where this replica left it
    ((5, 105.0), 102.0, (0, 200.0), True),   # the old engine, past this replica
    ((4, 104.0), 103.0, (3, 200.0), True),   # (seen through a catch-up at seq 3)
    ((0, 200.0), 103.0, (1, 201.0), False),  # the new engine, before the batch seen
    ((1, 201.0), 103.0, (1, 201.0), False),  # the new engine, at it
    ((4, 204.0), 103.0, (1, 201.0), False),  # the new engine, past it
])
def test_restart_purge_only_drops_the_old_engines_entries(srv, stored, last_ts, seen, purged):
    index = RedisIndex.from_url(f"redis://127.0.0.1:{srv.port}/0", 1.0)
    assert not index.purge_restarted(POD, last_ts, seen)  # nothing there (or purged already)
    assert index.apply(POD, stored[0], one_store(0), ts=stored[1])
    assert index.purge_restarted(POD, last_ts, seen) == purged
    r = redis.Redis(port=srv.port)
    assert held(r) == (set() if purged else {key(0)})
    assert r.get(ik.pod_seq_key(POD)) == (None if purged else str(stored[0]).encode())
    assert not r.exists(ik.pod_sync_key(POD))
