"""One request key from several engine hashes: two engine blocks with the same tokens
and parent but another LoRA, multimodal input or cache salt have their own engine
hashes and one request key. The pod holds the key until the last of them is gone,
in the local view and in Redis, through re-syncs and a gateway warmed from Redis."""

import random
from collections import Counter

import pytest
import redis
from redis_server import RedisServer

from sluice import index_keys as ik
from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.index.redis_index import RedisIndex

POD = "a:1"
BS = 4
KEYS = [f"{i:016x}" for i in range(1, 7)]  # few keys, many fields: keys are shared


@pytest.fixture
def srv():
    with RedisServer() as s:
        yield s


def test_local_view_keeps_a_key_until_its_last_engine_hash_goes():
    idx = LocalIndex()
    k, k2 = KEYS[0], KEYS[1]
    idx.store(POD, [("e1", k), ("e2", k)])
    idx.remove(POD, ["e1"])
    assert idx.lookup([k], [POD], 0) == {POD: 1}
    idx.store(POD, [("e2", k)])  # stored again: still one engine hash
    idx.remove(POD, ["e2"])
    assert idx.lookup([k], [POD], 0) == {}
    idx.store(POD, [("e1", k), ("e2", k)])
    idx.store(POD, [("e1", k2)])  # e1 now stands for another block
    idx.remove(POD, ["e2"])
    assert idx.lookup([k], [POD], 0) == {} and idx.lookup([k2], [POD], 0) == {POD: 1}
    idx.store(POD, [("e3", k2)])
    idx.clear(POD)
    idx.store(POD, [("e4", k2)])
    idx.remove(POD, ["e4"])  # (the clear dropped e1's and e3's counts too)
    assert idx.lookup([k2], [POD], 0) == {}


def _batches(rng: random.Random, first_seq: int, n: int):
    """(seq, cleared, stored, removed) as `translate` makes them: clear, then stores,
    then removals (a field stored then removed in one batch is in both)."""
    for seq in range(first_seq, first_seq + n):
        cleared = rng.random() < 0.03
        stored = [(f"e{rng.randrange(12)}", rng.choice(KEYS)) for _ in range(rng.randrange(5))]
        removed = [f"e{rng.randrange(12)}" for _ in range(rng.randrange(4))]
        yield seq, cleared, stored, removed


def _model(m: dict[str, str], cleared: bool, stored, removed) -> None:
    if cleared:
        m.clear()
    m.update(stored)
    for f in removed:
        m.pop(f, None)


def _check(index: PrefixIndex, r: redis.Redis, m: dict[str, str]) -> None:
    held = set(m.values())
    assert {f.decode(): k.decode() for f, k in r.hgetall(ik.pod_hashes_key(POD)).items()} == m
    assert {x.decode() for x in r.smembers(ik.pod_keys_key(POD))} == held
    dups = {k.decode(): int(n) for k, n in r.hgetall(ik.pod_key_dups_key(POD)).items()}
    assert dups == {k: n - 1 for k, n in Counter(m.values()).items() if n > 1}
    for k in KEYS:
        assert bool(r.sismember(ik.block_key(k), POD)) == (k in held), k
        assert index.local.lookup([k], [POD], 0) == ({POD: 1} if k in held else {}), k


def _feed(index: PrefixIndex, r: redis.Redis, m: dict[str, str], rng: random.Random,
          first_seq: int, n: int) -> int:
    for seq, cleared, stored, removed in _batches(rng, first_seq, n):
        index.apply(POD, seq, stored, removed, cleared, BS, ts=1000.0 + seq)
        _model(m, cleared, stored, removed)
        _check(index, r, m)
    return first_seq + n


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shared_keys_against_a_model_through_resync_and_warming(srv, seed):
    rng = random.Random(seed)
    url = f"redis://127.0.0.1:{srv.port}/0"
    r = redis.Redis(port=srv.port)
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(url, 1.0))
    m: dict[str, str] = {}
    seq = _feed(index, r, m, rng, 0, 150)
    r.flushdb()  # Redis lost everything: noticed, and re-synced from the local view
    index.apply(POD, seq, [], [], False, BS, ts=1000.0 + seq)
    assert index.mode == "local" and r.get(ik.pod_seq_key(POD)) is None  # not applied
    assert index.recover() and index.mode == "redis"
    seq += 1
    _check(index, r, m)
    seq = _feed(index, r, m, rng, seq, 150)
    warmed = PrefixIndex(LocalIndex(), RedisIndex.from_url(url, 1.0))  # a restarted gateway
    warmed.warm_from_redis(POD, seq - 1, 1000.0 + seq - 1)
    _check(warmed, r, m)
    _feed(warmed, r, m, rng, seq, 150)
