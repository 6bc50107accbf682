"""The gateway's engine connection pool (sluice.gateway.http_pool.HttpPool)
against scripted raw upstreams on loopback: keep-alive reuse, release, idle
expiry, the stale-connection retry and get(). Each test runs on asyncio's loop
and on uvloop."""

import asyncio
import functools
import time

import pytest
from http_testing import OK, Upstream, answer_each, fetch, run_on

from sluice.gateway.http_client import Disconnected, ReadTimeout
from sluice.gateway.http_pool import HttpPool


@pytest.fixture(params=["asyncio", "uvloop"])
def aio(request):
    return functools.partial(run_on, request.param)


def test_sequential_requests_reuse_one_connection(aio):
    async def main():
        async with Upstream(answer_each) as up:
            pool = HttpPool()
            ports = set()
            for _ in range(3):
                conn = await pool.request(up.url, "POST", "/v1/completions",
                                          {"x-request-id": "r1"}, b"{}", 1, 1)
                assert conn.status == 200 and await conn.read(1) == b"ok"
                ports.add(conn.transport.get_extra_info("sockname")[1])
                pool.release(conn)
            assert len(ports) == 1 and len(up.peers) == 1 and len(up.requests) == 3
            host = up.url.removeprefix("http://")
            assert up.requests[0] == (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
                                      "x-request-id: r1\r\ncontent-length: 2\r\n\r\n{}").encode()
            await pool.close()
    aio(main)


def test_user_info_in_an_engine_url_stays_out_of_the_host_header(aio):
    async def main():
        async with Upstream(answer_each) as up:
            pool = HttpPool()
            url = up.url.replace("http://", "http://user:secret@")
            assert await fetch(pool, url) == b"ok"
            host = up.url.removeprefix("http://")
            head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n".encode()
            assert up.requests[0].startswith(head)
            assert b"secret" not in up.requests[0]
            await pool.close()
    aio(main)


def test_a_connection_released_before_its_body_was_read_is_not_reused(aio):
    big = b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"b" * 100000

    async def main():
        async with Upstream(functools.partial(answer_each, answer=big)) as up:
            pool = HttpPool()
            conn = await pool.request(up.url, "GET", "/", {}, b"", 1, 1)
            pool.release(conn)  # body unread
            assert conn.closed or conn.transport.is_closing()
            assert len(await fetch(pool, up.url)) == 100000
            assert len(up.peers) == 2
            await pool.close()
    aio(main)


def test_an_idle_connection_closed_by_the_server_is_replaced(aio):
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(OK)  # ... then close while idle

    async def main():
        async with Upstream(script) as up:
            pool = HttpPool()
            assert await fetch(pool, up.url) == b"ok"
            await asyncio.sleep(0.05)
            assert await fetch(pool, up.url) == b"ok"
            assert len(up.peers) == 2
            await pool.close()
    aio(main)


def test_a_stale_reused_connection_is_retried_on_a_new_one(aio):
    """The server closed the idle connection just as the request went out (it
    read it, closed, answered nothing): sent once more, on a new connection."""
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(OK)
        await writer.drain()
        if len(up.peers) == 1:
            await up.read(reader)  # the next request: no answer, close
        else:
            await answer_each(reader, writer, up)

    async def main():
        async with Upstream(script) as up:
            pool = HttpPool()
            assert await fetch(pool, up.url) == b"ok"
            assert await fetch(pool, up.url) == b"ok"
            assert len(up.peers) == 2 and len(up.requests) == 3
            await pool.close()
    aio(main)


def test_a_fresh_connection_closed_before_answering_is_not_retried(aio):
    async def script(reader, writer, up):
        await up.read(reader)

    async def main():
        async with Upstream(script) as up:
            with pytest.raises(Disconnected):
                await fetch(HttpPool(), up.url)
            assert len(up.peers) == 1 and len(up.requests) == 1
    aio(main)


def test_idle_connections_expire_after_idle_s(aio):
    async def main():
        async with Upstream(answer_each) as up:
            pool = HttpPool(idle_s=0.1)
            old = await pool.request(up.url, "GET", "/", {}, b"", 1, 1)
            await old.read(1)
            pool.release(old)
            await asyncio.sleep(0.15)
            assert await fetch(pool, up.url) == b"ok"
            await asyncio.sleep(0.01)
            assert len(up.peers) == 2 and old.closed
            await pool.close()
    aio(main)


def test_pool_close_closes_idle_connections(aio):
    async def main():
        async with Upstream(answer_each) as up:
            pool = HttpPool()
            conn = await pool.request(up.url, "GET", "/", {}, b"", 1, 1)
            await conn.read(1)
            pool.release(conn)
            await pool.close()
            await asyncio.sleep(0.01)
            assert conn.closed
    aio(main)


def test_get_bounds_the_whole_exchange(aio):
    async def dribble(reader, writer, up):
        await up.read(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(40):  # a chunk every 50 ms: each read is quick, the whole is not
            writer.write(b"1\r\nx\r\n")
            await asyncio.sleep(0.05)

    async def main():
        async with Upstream(answer_each) as up:
            pool = HttpPool()
            assert await pool.get(up.url + "/health?x=1", 1) == (200, b"ok")
            assert await pool.get(up.url + "/health", 1) == (200, b"ok")
            assert len(up.peers) == 1 and up.requests[0].startswith(b"GET /health?x=1 ")
            await pool.close()
        async with Upstream(dribble) as up:
            started = time.monotonic()
            with pytest.raises(ReadTimeout):
                await HttpPool().get(up.url + "/health", 0.3)
            assert time.monotonic() - started < 0.6
    aio(main)
