"""Edge cases of the gateway's engine client and pool (stale retry on a new
connection, interim 1xx answers, protocol switches, idle connections of hosts no
longer asked), each once a fault found in review."""

import asyncio
import functools
import gc
import weakref

import pytest
from http_testing import OK, Upstream, answer_each, fetch, run_on

from sluice.gateway.http_client import Disconnected
from sluice.gateway.http_pool import HttpPool


@pytest.fixture(params=["asyncio", "uvloop"])
def aio(request):
    return functools.partial(run_on, request.param)


def test_retry_after_a_stale_connection_uses_a_new_connection(aio):
    async def script(reader, writer, up):
        first = len(up.peers) <= 2
        await up.read(reader)
        writer.write(OK)
        await writer.drain()
        if first:
            await up.read(reader)  # the engine restarted: read, no answer, close
        else:
            await answer_each(reader, writer, up)

    async def main():
        async with Upstream(script) as up:
            pool = HttpPool()
            a, b = [await pool.request(up.url, "GET", "/", {}, b"", 1, 1) for _ in range(2)]
            for conn in (a, b):
                await conn.read(1)
                pool.release(conn)
            assert await fetch(pool, up.url) == b"ok"
            await pool.close()
    aio(main)


def test_an_informational_answer_is_skipped(aio):
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(OK)
        await reader.read(1)

    async def main():
        async with Upstream(script) as up:
            conn = await HttpPool().request(up.url, "GET", "/", {}, b"", 1, 1)
            assert conn.status == 200 and await conn.read(1) == b"ok"
            assert "link" not in conn.headers
            conn.close()
    aio(main)


def test_connections_of_a_host_no_longer_asked_are_dropped(aio):
    async def once(reader, writer, up):
        await up.read(reader)
        writer.write(OK)  # ... then close: the pod went away

    async def main():
        async with Upstream(once) as gone, Upstream(answer_each) as live:
            pool = HttpPool(idle_s=0.05)
            conn = await pool.request(gone.url, "GET", "/", {}, b"", 1, 1)
            await conn.read(1)
            pool.release(conn)
            ref = weakref.ref(conn)
            del conn
            await asyncio.sleep(0.1)
            assert await fetch(pool, live.url) == b"ok"
            gc.collect()
            assert ref() is None
            await pool.close()
    aio(main)


def test_a_protocol_switch_answer_is_a_disconnect(aio):
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\n"
                     b"upgrade: other\r\n\r\nnot http")
        await reader.read(1)

    async def main():
        async with Upstream(script) as up:
            with pytest.raises(Disconnected):
                await fetch(HttpPool(), up.url)
    aio(main)  # (run_on also fails on the loop's error report)
