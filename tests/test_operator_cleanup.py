"""The finalizer's index cleanup against a real Redis with the gateway's key layout."""

from __future__ import annotations

import asyncio

import pytest

from sluice import index_keys
from sluice.operator import cleanup

redis = pytest.importorskip("redis")
redis_server = pytest.importorskip("redis_server")


def test_pool_pod_ids_from_status_and_live_pods():
    status = [{"url": "http://10.0.0.1:8000"}, {"url": "http://10.0.0.2:8000"}]
    pods = [{"status": {"podIP": "10.0.0.2"}}, {"status": {"podIP": "10.0.0.3"}}, {"status": {}}]
    assert cleanup.pool_pod_ids(status, pods) == ["10.0.0.1:8000", "10.0.0.2:8000",
                                                   "10.0.0.3:8000"]


def test_redis_purger_removes_the_pools_pods_and_only_them():
    with redis_server.RedisServer() as srv:
        r = redis.Redis.from_url(srv.url)
        gone, stays, stale = "10.0.0.1:8000", "10.9.0.1:8000", "10.0.0.7:8000"
        for pod, pool in ((gone, "a"), (stays, "b"), (stale, "a")):
            r.hset(index_keys.pod_meta_key(pod), mapping={"namespace": "ns", "pool": pool})
            r.sadd(index_keys.pod_keys_key(pod), "k1", f"k-{pod}")
            r.sadd(index_keys.block_key("k1"), pod)
            r.sadd(index_keys.pool_pods_key("ns", pool), pod)
        # `stale` is only in Redis (the pod is gone from the cluster already)
        purged = asyncio.run(cleanup.redis_purger(srv.url)("ns", "a", [gone]))
        assert purged == 4
        assert r.smembers(index_keys.block_key("k1")) == {stays.encode()}
        assert not r.exists(index_keys.pod_keys_key(gone), index_keys.pod_meta_key(stale),
                            index_keys.pool_pods_key("ns", "a"))
        assert r.smembers(index_keys.pool_pods_key("ns", "b")) == {stays.encode()}
        r.close()


def test_redis_load_table_is_the_autoscalers_fallback_source():
    from sluice.operator import redis_load
    from sluice.operator.autoscale import LoadSample

    endpoints = [{"url": f"http://10.0.0.{i}:8000", "ready": True, "role": "serve"}
                 for i in (1, 2, 3)] + [{"url": "http://10.0.0.9:8000", "ready": True,
                                          "role": "decode"}]
    with redis_server.RedisServer() as srv:
        r = redis.Redis.from_url(srv.url)
        r.hset(index_keys.load_key("10.0.0.1:8000"),
               mapping={"waiting": 4, "running": 2, "kv_usage": 0.8, "ts_ms": 1})
        r.hset(index_keys.load_key("10.0.0.2:8000"),
               mapping={"waiting": 0, "running": 1, "kv_usage": 0.2, "ts_ms": 1})
        # 10.0.0.3 has no entry (expired): unknown, left out
        sampler = redis_load.redis_sampler(srv.url)

        async def unreachable(endpoints, role):
            return None

        async def scenario():
            both = redis_load.first_of(unreachable, sampler)
            return (await both(endpoints, "serve"), await sampler(endpoints, "decode"))

        serve, decode = asyncio.run(scenario())
        assert serve == LoadSample(0.5, 2.0, 2) and decode is None
        r.close()
    # Redis down: no sample rather than an error
    assert asyncio.run(redis_load.redis_sampler(srv.url)(endpoints, "serve")) is None
