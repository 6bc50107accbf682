"""The index's calls from request handlers (redis-py's asyncio client, bounded by
deadlines: `redis_script`) against a real redis-server: outages, slow and silent
connections, restarts, lost scripts, the pool's bound."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis_server import RedisServer

from sluice import index_keys as ik
from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.index.redis_apply import encode_ops
from sluice.gateway.index.redis_index import (
    HEALTH_CHECK_INTERVAL_S,
    POOL_SIZE,
    RedisIndex,
)
from sluice.gateway.index.redis_script import Script, run_scripts

BS = 4
KEYS = [f"{i:016x}" for i in range(1, 9)]


@pytest.fixture
def srv():
    with RedisServer() as s:
        yield s


def stored(index: RedisIndex, pod: str, n: int) -> None:
    """`pod` holds the first `n` keys in Redis."""
    index.apply(pod, 0, encode_ops([(f"e{i}", k) for i, k in enumerate(KEYS[:n])], [], False,
                                   BS), ts=1.0)


async def hits(index: RedisIndex, pods: list[str], within_s: float = 2.0) -> dict[str, int]:
    return (await index.lookup(KEYS, pods, time.time() * 1000, time.monotonic() + within_s))[0]


def normal_clients(port: int) -> int:
    """Connections to Redis from clients, this inspecting one excluded."""
    return len(redis.Redis(port=port).client_list(_type="normal")) - 1


def test_a_lookup_cut_by_its_deadline_leaves_no_reply_behind(srv):
    """Redis is busy (another client's slow script): a lookup past its deadline
    raises the builtin TimeoutError, and the lookups after it, concurrent ones
    included, each get their own answer, not the abandoned one's."""
    index = RedisIndex.from_url(srv.url, 1.0)
    for n, pod in enumerate(["p1:1", "p2:1", "p3:1"], start=1):
        stored(index, pod, n)
    spin = ("local t = redis.call('TIME') while true do local n = redis.call('TIME') "
            "if (n[1]-t[1])*1e6 + (n[2]-t[2]) > 300000 then return 1 end end")
    busy = threading.Thread(target=redis.Redis(port=srv.port).eval, args=(spin, 0))

    async def main():
        assert await hits(index, ["p1:1"]) == {"p1:1": 1}  # (connected)
        busy.start()
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await hits(index, ["p1:1"], within_s=0.05)
        assert time.monotonic() - t0 < 0.25  # (not the 300 ms the script runs)
        busy.join()
        got = await asyncio.gather(*(hits(index, [pod]) for pod in ["p3:1", "p1:1", "p2:1"] * 5))
        assert got == [{"p3:1": 3}, {"p1:1": 1}, {"p2:1": 2}] * 5
        await index.aio.aclose()
    asyncio.run(main())


def test_redis_killed_mid_lookup_fails_it_and_the_index_reconnects_after_recovery(srv):
    index = PrefixIndex(LocalIndex(), RedisIndex.from_url(srv.url, 0.5), lookup_timeout_s=2.0)
    index.apply("p:1", 0, [(f"e{i}", k) for i, k in enumerate(KEYS[:2])], [], False, BS, ts=1.0)

    async def lookup() -> dict[str, int]:
        return (await index.lookup(KEYS, ["p:1"])).hits

    async def main():
        assert await lookup() == {"p:1": 2} and index.mode == "redis"
        srv.pause()  # the lookup's request reaches Redis, which dies before answering
        pending = asyncio.ensure_future(lookup())
        await asyncio.sleep(0.1)
        assert not pending.done()
        t0 = time.monotonic()
        srv.stop()
        assert await pending == {"p:1": 2}  # the local view's answer
        assert time.monotonic() - t0 < 1.0, "the lost connection fails the call at once"
        assert index.mode == "local"
        srv.start()  # an empty Redis, on the same port
        assert index.recover() and index.mode == "redis"  # (re-synced from the view)
        assert await lookup() == {"p:1": 2}  # read from Redis, on a new connection
        assert index.mode == "redis"
        await index.redis.aio.aclose()
    asyncio.run(main())


def test_a_refused_connection_is_a_connection_error(srv):
    index = RedisIndex.from_url(srv.url, 0.5)
    srv.stop()

    async def main():
        with pytest.raises(RedisConnectionError):
            await hits(index, ["p:1"])
        with pytest.raises(RedisConnectionError):
            await index.write_loads({}, 1000, ["p:1"])
        await index.aio.aclose()
    asyncio.run(main())


def test_connections_closed_by_redis_while_idle_are_replaced_before_use(srv):
    index = RedisIndex.from_url(srv.url, 0.5)
    kwargs = index.aio.connection_pool.connection_kwargs
    assert kwargs["health_check_interval"] == HEALTH_CHECK_INTERVAL_S
    stored(index, "p:1", 3)

    async def main():
        assert await hits(index, ["p:1"]) == {"p:1": 3}
        redis.Redis(port=srv.port).client_kill_filter(_type="normal", skipme=True)
        await asyncio.sleep(0.05)
        assert await hits(index, ["p:1"]) == {"p:1": 3}  # not an error: a new connection
        await index.aio.aclose()
    asyncio.run(main())


class SilentProxy:
    """TCP proxy to Redis whose open connections can be made to go silent (bytes
    are swallowed, sockets stay open); connections opened later still forward."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self._silent: set[int] = set()  # (connection numbers)
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def silence(self) -> None:
        self._silent.update(range(1, self.connections + 1))

    def close(self) -> None:
        self.server.close()
        for w in self._writers:
            w.close()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = self.connections
        rr, rw = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [cw, rw]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if n not in self._silent:
                    dst.write(data)
        await asyncio.gather(pump(cr, rw), pump(rr, cw), return_exceptions=True)


def test_a_connection_gone_silent_times_out_and_is_replaced(srv):
    """Redis (behind a proxy) stops answering on the open connection without closing
    it: a lookup and a flush are bounded by their deadline, not by the client's
    5 s timeout, and the next call goes over a new connection."""
    async def main():
        proxy = SilentProxy(srv.port)
        index = RedisIndex.from_url(f"redis://127.0.0.1:{await proxy.start()}/0", 5.0)
        assert await hits(index, ["p:1"]) == {}
        proxy.silence()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await hits(index, ["p:1"], within_s=0.1)
        assert 0.09 < time.monotonic() - t0 < 1.0
        assert await hits(index, ["p:1"]) == {}  # a new connection
        assert proxy.connections == 2
        proxy.silence()
        index.speculate_later("p:1", KEYS[:2], 60_000, time.time() * 1000)
        index.speculate_later("q:1", KEYS[:1], 60_000, time.time() * 1000)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await index.flush(t0 + 0.1)  # a pipeline of two script calls
        assert 0.09 < time.monotonic() - t0 < 1.0
        assert await hits(index, ["p:1"]) == {} and proxy.connections == 3
        await index.aio.aclose()
        proxy.close()
    asyncio.run(main())


def test_a_deadline_bounds_the_connect_to_a_redis_that_does_not_answer():
    async def main():
        accepted: list[asyncio.StreamWriter] = []
        mute = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
        port = mute.sockets[0].getsockname()[1]
        index = RedisIndex.from_url(f"redis://127.0.0.1:{port}/1", 5.0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await hits(index, ["p:1"], within_s=0.1)  # (the handshake is never answered)
        assert time.monotonic() - t0 < 1.0
        await index.aio.aclose()
        mute.close()
        for w in accepted:
            w.close()
    asyncio.run(main())


def test_scripts_are_loaded_when_redis_lacks_them(srv):
    index = RedisIndex.from_url(srv.url, 1.0)
    stored(index, "p:1", 2)
    r = redis.Redis(port=srv.port)

    async def main():
        r.script_flush()
        assert await hits(index, ["p:1"]) == {"p:1": 2}  # EVALSHA, then EVAL
        assert r.script_exists(index._lookup.sha) == [True]
        # several calls in one write: those Redis lacks are loaded, order kept
        r.script_flush()
        c = index.aio
        s, t = Script(c, "return ARGV[1] .. ARGV[2]"), Script(c, "return 'T' .. ARGV[1]")
        deadline = time.monotonic() + 2
        assert await t(["0"], deadline) == b"T0"
        assert await run_scripts(c, [(s, ["1", "2"]), (t, ["3"]), (s, ["4", "5"])],
                                 deadline) == [b"12", b"T3", b"45"]
        # an error reply is raised, after every reply was read
        bad = Script(c, "return redis.call('INCR', ARGV[1])")
        r.set("notnum", "x")
        with pytest.raises(ResponseError):
            await run_scripts(c, [(s, ["1", "2"]), (bad, ["notnum"])], deadline)
        with pytest.raises(ResponseError):
            await bad(["notnum"], deadline)
        assert await hits(index, ["p:1"]) == {"p:1": 2}
        await c.aclose()
    asyncio.run(main())


def test_concurrent_lookups_share_a_bounded_pool(srv):
    index = RedisIndex.from_url(srv.url, 1.0)
    for n, pod in enumerate(["p1:1", "p2:1", "p3:1"], start=1):
        stored(index, pod, n)
    index.sync.close()  # (only the asyncio client's connections are counted)
    pods = ["p1:1", "p2:1", "p3:1"] * 40

    async def main():
        got = await asyncio.gather(*(hits(index, [pod]) for pod in pods))
        assert got == [{pod: int(pod[1])} for pod in pods]
        assert 1 <= normal_clients(srv.port) <= POOL_SIZE
        await index.aio.aclose()
    asyncio.run(main())


def test_password_and_database_are_read_from_the_url():
    with RedisServer(extra_args=("--requirepass", "s3cret")) as srv:
        index = RedisIndex.from_url(f"redis://:s3cret@127.0.0.1:{srv.port}/3", 1.0)
        wrong = RedisIndex.from_url(f"redis://:wrong-pass@127.0.0.1:{srv.port}/3", 1.0)

        async def main():
            assert await index.write_loads({"p:1": {"waiting": 1, "running": 2,
                                                    "kv_usage": 0.5, "ts_ms": 7}}, 60_000,
                                           ["p:1"]) == {"p:1": {"waiting": 1, "running": 2,
                                                                "kv_usage": 0.5, "ts_ms": 7}}
            with pytest.raises(redis.exceptions.RedisError) as err:
                await hits(wrong, ["p:1"])
            assert "wrong-pass" not in str(err.value)
            await index.aio.aclose()
            await wrong.aio.aclose()
        asyncio.run(main())
        r = redis.Redis(port=srv.port, password="s3cret", db=3)
        assert r.exists(ik.load_key("p:1"))
        assert redis.Redis(port=srv.port, password="s3cret", db=0).dbsize() == 0
