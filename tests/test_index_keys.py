import redis
from redis_server import RedisServer

from sluice import index_keys as ik


def test_layout_names():
    assert ik.block_key("00ff") == "sluice:blk:00ff"
    assert ik.pool_pods_key("ns", "p1") == "sluice:pool:ns/p1:pods"
    assert ik.load_key("10.0.0.1:8000") == "sluice:load:10.0.0.1:8000"
    assert ik.engine_hash_field(b"\x01\x02") == "0102"
    assert ik.engine_hash_field(-5) == "-5"
    assert ik.parse_load({b"waiting": b"2", b"running": b"3", b"kv_usage": b"0.5",
                          b"ts_ms": b"1"}) == {"waiting": 2, "running": 3, "kv_usage": 0.5,
                                               "ts_ms": 1}
    assert ik.parse_load({}) is None


def test_purge_pods_removes_only_that_pod():
    with RedisServer() as srv:
        r = redis.Redis(port=srv.port)
        for pod in ("a:1", "b:2"):
            r.hset(ik.pod_meta_key(pod), mapping={"namespace": "ns", "pool": "p",
                                                  "block_size": 16})
            r.sadd(ik.pool_pods_key("ns", "p"), pod)
            r.hset(ik.load_key(pod), mapping={"waiting": 0, "running": 0, "kv_usage": 0,
                                              "ts_ms": 0})
            r.set(ik.pod_seq_key(pod), 3)
            r.zadd(ik.pod_spec_key(pod), {"k": 1e18})
            for i in range(2500):
                k = f"{i:016x}"
                r.sadd(ik.block_key(k), pod)
                r.sadd(ik.pod_keys_key(pod), k)
                r.hset(ik.pod_hashes_key(pod), str(i), k)
        assert ik.purge_pods(r, ["a:1"]) == 2500
        assert r.smembers(ik.block_key(f"{7:016x}")) == {b"b:2"}
        assert r.smembers(ik.pool_pods_key("ns", "p")) == {b"b:2"}
        assert r.exists(ik.pod_spec_key("b:2"))
        for k in (ik.pod_spec_key("a:1"), ik.pod_keys_key("a:1"), ik.pod_hashes_key("a:1"), ik.pod_seq_key("a:1"),
                  ik.pod_meta_key("a:1"), ik.load_key("a:1")):
            assert not r.exists(k)
        assert r.scard(ik.pod_keys_key("b:2")) == 2500
        assert ik.purge_pods(r, ["a:1", "gone:9"]) == 0
