"""Several gateway replicas writing one pod's entries to one Redis: a replica
re-syncing after an outage never loses what another replica applied."""

import time

import pytest
import redis
from redis_server import RedisServer

from sluice import index_keys as ik
from sluice.gateway.local_index import LocalIndex
from sluice.gateway.prefix_index import PrefixIndex
from sluice.gateway.redis_apply import encode_ops
from sluice.gateway.redis_index import RedisIndex
from sluice.gateway.resp_client import RespClient

POD = "x:1"
BS = 4


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
    a = RedisIndex(a_client, RespClient(url, timeout_s=1.0))
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


def test_a_rewrite_abandoned_half_way_is_taken_over(srv):
    """Replica A dies in the middle of a re-sync: B's batches are refused while A's
    lease lasts, then B rewrites the pod from its own view."""
    url = f"redis://127.0.0.1:{srv.port}/0"
    b = PrefixIndex(LocalIndex(), RedisIndex.from_url(url, 1.0))
    for i in range(4):
        b.apply(POD, i, [(f"e{i}", key(i))], [], False, BS, ts=100.0 + i)
    a_client = AfterBigWrite(port=srv.port)
    a = RedisIndex(a_client, RespClient(url, timeout_s=1.0), lease_ms=300)

    def dies():
        raise RuntimeError("replica A is gone")

    a_client.hook = dies
    with pytest.raises(RuntimeError):
        a.resync(POD, 5, 105.0, {f"f{j}": f"{j + 100:016x}" for j in range(12_000)}, BS)
    r = redis.Redis(port=srv.port)
    assert r.exists(ik.pod_sync_key(POD)) and 0 < r.scard(ik.pod_keys_key(POD)) < 12_000
    b.apply(POD, 4, [("e4", key(4))], [], False, BS, ts=104.0)  # fenced: refused
    assert r.get(ik.pod_seq_key(POD)) == b"3"
    time.sleep(0.35)
    b.apply(POD, 5, [("e5", key(5))], [], False, BS, ts=105.0)  # lapsed: B re-syncs
    assert held(r) == {key(i) for i in range(6)} and r.get(ik.pod_seq_key(POD)) == b"5"
    assert not r.exists(ik.pod_sync_key(POD)) and b.mode == "redis"
