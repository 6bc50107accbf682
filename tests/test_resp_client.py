"""The gateway's lean asyncio Redis client against a real redis-server."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis_server import RedisServer

from sluice.gateway.redis_script import Script, run_scripts
from sluice.gateway.resp_client import RespClient, encode_command


def run(coro):
    return asyncio.run(coro)


def test_encode_command_is_resp_bulk_strings():
    assert encode_command(("SET", "k", b"\x00v", 12, 1.5)) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n\x00v\r\n$2\r\n12\r\n$3\r\n1.5\r\n")
    with pytest.raises(TypeError):
        encode_command(("SET", "k", None))


def test_concurrent_calls_get_their_own_replies_in_order():
    with RedisServer() as srv:
        async def main():
            c = RespClient(srv.url)
            await c.call("SET", "k", "v")
            got = await asyncio.gather(*(c.call("ECHO", f"m{i}") for i in range(200)))
            assert got == [f"m{i}".encode() for i in range(200)]
            assert await c.pipeline([("INCR", "n"), ("INCR", "n"), ("GET", "k")]) == [1, 2, b"v"]
            with pytest.raises(ResponseError):
                await c.call("INCR", "k")  # not an integer
            assert await c.call("GET", "k") == b"v"  # the error left the connection usable
            await c.aclose()
        run(main())


def test_a_caller_that_stops_waiting_does_not_shift_later_replies():
    with RedisServer() as srv:
        async def main():
            c = RespClient(srv.url)
            slow = asyncio.ensure_future(c.call("EVAL", "local t = redis.call('TIME') "
                                                "while true do local n = redis.call('TIME') "
                                                "if (n[1]-t[1])*1e6 + (n[2]-t[2]) > 200000 "
                                                "then return 'slow' end end", 0))
            await asyncio.sleep(0.05)
            slow.cancel()
            assert await c.call("ECHO", "after") == b"after"
            await c.aclose()
        run(main())


def test_connection_loss_fails_pending_calls_and_the_next_call_reconnects():
    with RedisServer() as srv:
        async def main():
            c = RespClient(srv.url, timeout_s=0.5)
            await c.call("SET", "k", "1")
            srv.stop()
            with pytest.raises(RedisConnectionError):
                await c.call("GET", "k")
            with pytest.raises(RedisConnectionError):
                await c.call("GET", "k")  # refused, and says so
            srv.start()
            assert await c.call("PING") == b"PONG"
            await c.aclose()
        run(main())


def test_a_connection_closed_by_redis_while_idle_is_replaced_before_use():
    with RedisServer() as srv:
        async def main():
            c = RespClient(srv.url, health_check_interval_s=0.1)
            await c.call("PING")
            redis.Redis(port=srv.port).client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.2)
            assert await c.call("PING") == b"PONG"  # not an error: a new connection
            await c.aclose()
        run(main())


class SilentProxy:
    """TCP proxy to Redis whose existing connections can be made to go silent
    (bytes are swallowed, sockets stay open); new connections still forward."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silent = False
        self.connections = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        rr, rw = await asyncio.open_connection("127.0.0.1", self.port)
        born_silent = self.silent

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if not (self.silent and not born_silent):
                    dst.write(data)
        await asyncio.gather(pump(cr, rw), pump(rr, cw), return_exceptions=True)


def test_a_connection_gone_silent_is_replaced_after_the_timeout():
    with RedisServer() as srv:
        async def main():
            proxy = SilentProxy(srv.port)
            port = await proxy.start()
            c = RespClient(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
            assert await c.call("PING") == b"PONG"
            proxy.silent = True  # the current connection now swallows everything
            for _ in range(3):
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await c.call("PING")
            await asyncio.sleep(0.35)
            proxy.silent = False  # (only the next connection is not silent)
            async with asyncio.timeout(5):  # (on the silent connection it would never answer)
                assert await c.call("PING") == b"PONG"  # a new connection
            assert proxy.connections == 2
            proxy.server.close()
            await c.aclose()
        run(main())


def test_password_and_database_from_the_url_and_no_password_in_errors():
    with RedisServer(extra_args=("--requirepass", "s3cret")) as srv:
        async def main():
            good = RespClient(f"redis://:s3cret@127.0.0.1:{srv.port}/3")
            await good.call("SET", "k", "in-db-3")
            assert redis.Redis(port=srv.port, password="s3cret", db=3).get("k") == b"in-db-3"
            assert redis.Redis(port=srv.port, password="s3cret", db=0).get("k") is None
            await good.aclose()
            bad = RespClient(f"redis://:wrong-pass@127.0.0.1:{srv.port}/0")
            with pytest.raises(ResponseError) as err:
                await bad.call("PING")
            assert "wrong-pass" not in str(err.value)
        run(main())
    refused = RespClient("redis://:s3cret@127.0.0.1:1/0", timeout_s=0.5)
    with pytest.raises(RedisConnectionError) as err:
        run(refused.call("PING"))
    assert "s3cret" not in str(err.value)
    with pytest.raises(ValueError):
        RespClient("http://127.0.0.1:6379")
    with pytest.raises(ValueError):
        RespClient("redis://127.0.0.1:6379/0?socket_timeout=5")  # not silently ignored


def test_url_options_are_read_as_redis_py_reads_them(tmp_path):
    sock = tmp_path / "a b" / "redis.sock"
    sock.parent.mkdir()
    with RedisServer(extra_args=("--requirepass", "pw", "--unixsocket", str(sock))) as srv:
        async def main():
            c = RespClient(f"redis://127.0.0.1:{srv.port}?password=pw&db=2")
            await c.call("SET", "k", "v2")
            u = RespClient(f"unix://{str(sock).replace(' ', '%20')}?db=2&password=pw")
            assert await u.call("GET", "k") == b"v2"
            await c.aclose()
            await u.aclose()
        run(main())


def test_script_is_loaded_when_redis_does_not_have_it():
    with RedisServer() as srv:
        async def main():
            c = RespClient(srv.url)
            s = Script(c, "return ARGV[1] .. ARGV[2]")
            assert await s(["a", "k"]) == b"ak"
            await c.call("SCRIPT", "FLUSH")
            assert await s(["b", "x"]) == b"bx"
            assert await c.call("SCRIPT", "EXISTS", s.sha) == [1]
            # several calls in one write: those Redis lacks are loaded, order kept
            await c.call("SCRIPT", "FLUSH")
            t = Script(c, "return 'T' .. ARGV[1]")
            await t(["0"])
            assert await run_scripts(c, [(s, ["1", "2"]), (t, ["3"]), (s, ["4", "5"])]) == [
                b"12", b"T3", b"45"]
            # an error reply of one is raised (after every reply was read)
            bad = Script(c, "return redis.call('INCR', ARGV[1])")
            await c.call("SET", "notnum", "x")
            with pytest.raises(ResponseError):
                await run_scripts(c, [(s, ["1", "2"]), (bad, ["notnum"])])
            assert await c.call("PING") == b"PONG"
            await c.aclose()
        run(main())


def test_a_deadline_bounds_a_call_and_a_connect_that_get_no_answer():
    async def main():
        # a server that accepts and never answers: the SELECT of /1 waits for good
        mute = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = mute.sockets[0].getsockname()[1]
        c = RespClient(f"redis://127.0.0.1:{port}/1", timeout_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await c.call("PING", deadline=t0 + 0.1)  # the connect is bounded, not 5 s
        assert time.monotonic() - t0 < 1.0
        mute.close()
        await c.aclose()

        with RedisServer() as srv:
            proxy = SilentProxy(srv.port)
            c = RespClient(f"redis://127.0.0.1:{await proxy.start()}/0", timeout_s=5.0)
            assert await c.call("PING", deadline=time.monotonic() + 2) == b"PONG"
            proxy.silent = True
            for n in (1, 3):  # one call, and a pipeline of three
                t0 = time.monotonic()
                with pytest.raises(TimeoutError):
                    await c.pipeline([("PING",)] * n, deadline=t0 + 0.1)
                assert 0.09 < time.monotonic() - t0 < 1.0
            proxy.server.close()
            await c.aclose()
    run(main())
