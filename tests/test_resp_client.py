"""The gateway's lean asyncio Redis client against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis_server import RedisServer

from sluice.gateway.resp_client import RespClient, Script, encode_command


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
            c = RespClient(srv.url, connect_timeout_s=0.5)
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
    refused = RespClient("redis://:s3cret@127.0.0.1:1/0", connect_timeout_s=0.5)
    with pytest.raises(RedisConnectionError) as err:
        run(refused.call("PING"))
    assert "s3cret" not in str(err.value)
    with pytest.raises(ValueError):
        RespClient("http://127.0.0.1:6379")


def test_script_is_loaded_when_redis_does_not_have_it():
    with RedisServer() as srv:
        async def main():
            c = RespClient(srv.url)
            s = Script(c, "return ARGV[1] .. KEYS[1]")
            assert await s(keys=["k"], args=["a"]) == b"ak"
            await c.call("SCRIPT", "FLUSH")
            assert await s(keys=["x"], args=["b"]) == b"bx"
            assert await c.call("SCRIPT", "EXISTS", s.sha) == [1]
            await c.aclose()
        run(main())
