"""The chart's Redis, run for real with the chart's own arguments: each component's user
can do its work and no more (`templates/redis.yaml`, `sluice.redisAcl*`)."""

import asyncio
import re
import time

import pytest
import redis
from redis_server import RedisServer
from test_chart import render

from sluice import index_keys as ik
from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.redis_apply import encode_ops
from sluice.gateway.index.redis_index import RedisIndex
from sluice.gateway.index.spec_mirror import SpecMirror
from sluice.gateway.server.rate_limit import Limits, RateLimiter

KEYS = [f"{i:016x}" for i in range(1, 9)]
PASSWORDS = {"REDIS_PASSWORD": "adminpw", "REDIS_PICKER_PASSWORD": "pickerpw",
             "REDIS_OPERATOR_PASSWORD": "operatorpw"}


@pytest.fixture(scope="module")
def acl_redis():
    sts = next(m for m in render() if m["kind"] == "StatefulSet"
               and m["metadata"]["name"].endswith("-redis"))
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "redis-server"
    # the kubelet's $(VAR) expansion; the server's own port and data folder are the harness's
    args = [re.sub(r"\$\((\w+)\)", lambda m: PASSWORDS[m.group(1)], a) for a in args[1:]]
    for flag in ("--save", "--appendonly"):  # (RedisServer sets these itself)
        i = args.index(flag)
        del args[i:i + 2]
    with RedisServer(extra_args=tuple(args)) as srv:
        yield srv


def url(srv, user: str) -> str:
    password = PASSWORDS[f"REDIS_{user.upper()}_PASSWORD"]
    return f"redis://{user}:{password}@127.0.0.1:{srv.port}/0"


def test_the_picker_user_runs_the_index_and_the_speculation_channel(acl_redis):
    index = RedisIndex.from_url(url(acl_redis, "picker"), 1.0)
    view = LocalIndex()
    mirror = SpecMirror(redis.Redis.from_url(url(acl_redis, "picker")), view, "other", 60_000)
    mirror.start()
    try:
        assert mirror.subscribed.wait(5)
        index.register_pod("a:1", "ns", "pool", "m")
        index.apply("a:1", 0, encode_ops([(f"e{i}", k) for i, k in enumerate(KEYS)], [], False,
                                         16), ts=1.0)

        async def work():
            hits = (await index.lookup(KEYS, ["a:1"], time.time() * 1000,
                                       time.monotonic() + 2))[0]
            index.speculate_later("b:2", KEYS[:3], 60_000, time.time() * 1000)
            await index.flush(time.monotonic() + 2)  # (its script publishes the decision)
            await index.write_loads({"a:1": {"waiting": 1.0, "running": 2.0,
                                             "kv_usage": 0.5, "ts_ms": time.time() * 1000}},
                                    1000, ["a:1"], time.monotonic() + 2)
            # the per-key limits' script, under the same user
            limiter = RateLimiter(Limits(requests_per_minute=1), index.aio, timeout_s=2.0)
            assert await limiter.admit("team-a", 10) is None
            assert await limiter.admit("team-a", 10) is not None
            assert not limiter._warned  # (counted in Redis, not on this replica alone)
            await index.aio.aclose()
            return hits

        assert asyncio.run(work()) == {"a:1": len(KEYS)}
        deadline = time.time() + 5
        while view.lookup(KEYS, ["b:2"], time.time() * 1000) != {"b:2": 3}:
            assert time.time() < deadline, "the decision did not reach the mirror"
            time.sleep(0.02)
    finally:
        mirror.stop()
    picker = redis.Redis.from_url(url(acl_redis, "picker"))
    picker.pubsub_numsub(ik.SPEC_CHANNEL)  # (the SPECULATE script asks who listens)
    for forbidden in (("FLUSHALL",), ("KEYS", "*"), ("SET", "elsewhere", "1"),
                      ("CONFIG", "GET", "*"), ("DEBUG", "SLEEP", "0")):
        with pytest.raises(redis.ResponseError):
            picker.execute_command(*forbidden)


def test_the_operator_user_purges_and_reads_loads_but_cannot_forge_decisions(acl_redis):
    op = redis.Redis.from_url(url(acl_redis, "operator"))
    picker = redis.Redis.from_url(url(acl_redis, "picker"))
    picker.hset(ik.load_key("c:3"), mapping={"waiting": 0, "running": 0, "kv_usage": 0.1,
                                               "ts_ms": time.time() * 1000})
    assert op.hgetall(ik.load_key("c:3"))  # the autoscaler's read
    ik.purge_pods(op, ["c:3"])  # the finalizer's cleanup
    assert not picker.exists(ik.load_key("c:3"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        op.publish(ik.SPEC_CHANNEL, "forged\na:1\n9999999999999\n" + KEYS[0])
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis.port).set("sluice:x", 1)  # no credentials: nothing
