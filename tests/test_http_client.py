"""The gateway's engine client (sluice.gateway.http_client.Connection, used through
sluice.gateway.http_pool.HttpPool) against scripted raw upstreams on loopback:
body framings, when a connection is kept, and every failure kind. Each test
runs on asyncio's loop and on uvloop."""

import asyncio
import functools
import socket
import time

import pytest
from http_testing import Upstream, fetch, run_on

from sluice.gateway.http_client import (HIGH_WATER, ConnectError, ConnectTimeout, Disconnected,
                                        ReadTimeout)
from sluice.gateway.http_pool import HttpPool


@pytest.fixture(params=["asyncio", "uvloop"])
def aio(request):
    return functools.partial(run_on, request.param)


ANSWERS = {
    "content-length": (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world", True),
    "chunked": (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n", True),
    "close-delimited": (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nhello world", False),
    "connection-close": (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 11\r\n\r\n"
                         b"hello world", False),
    "http10": (b"HTTP/1.0 200 OK\r\ncontent-length: 11\r\n\r\nhello world", False),
}


@pytest.mark.parametrize("answer, kept", ANSWERS.values(), ids=ANSWERS.keys())
def test_body_framings_and_whether_the_connection_is_kept(aio, answer, kept):
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(answer)
        if b"content-length" not in answer and b"chunked" not in answer:
            writer.close()  # the body ends with the connection
            return
        await up.read(reader)  # b"" once the client closed it
        writer.write(answer)

    async def main():
        async with Upstream(script) as up:
            pool = HttpPool()
            conn = await pool.request(up.url, "GET", "/", {}, b"", 1, 1)
            assert await conn.read(1) == b"hello world" and conn.reusable() == kept
            pool.release(conn)
            assert await fetch(pool, up.url) == b"hello world"
            assert len(up.peers) == (1 if kept else 2)
            await pool.close()
    aio(main)


def test_chunks_are_handed_over_as_they_arrive_and_a_stall_is_a_read_timeout(aio):
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n")
        await reader.read(1)  # until the client closes

    async def main():
        async with Upstream(script) as up:
            conn = await HttpPool().request(up.url, "GET", "/", {}, b"", 1, 1)
            assert await conn.chunk(1) == b"ab"
            with pytest.raises(ReadTimeout):  # between chunks
                await conn.chunk(0.1)
            conn.close()
    aio(main)


def test_a_connection_cut_mid_body_raises_disconnected(aio):
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")

    async def main():
        async with Upstream(script) as up:
            pool = HttpPool()
            conn = await pool.request(up.url, "GET", "/", {}, b"", 1, 1)
            with pytest.raises(Disconnected, match="mid-answer"):
                await conn.read(1)
            assert not conn.reusable()
    aio(main)


@pytest.mark.parametrize("answer", [b"NOT HTTP AT ALL\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"])
def test_a_malformed_answer_raises_disconnected(aio, answer):
    async def script(reader, writer, up):
        await up.read(reader)
        writer.write(answer)
        await reader.read(1)

    async def main():
        async with Upstream(script) as up:
            with pytest.raises(Disconnected, match="malformed"):
                await fetch(HttpPool(), up.url)
    aio(main)


def test_connect_refused_raises_connect_error(aio):
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(ConnectError) as err:
            await fetch(HttpPool(), f"http://127.0.0.1:{port}")
        assert not isinstance(err.value, ConnectTimeout)
        with pytest.raises(ConnectError):
            await fetch(HttpPool(), "ftp://127.0.0.1:21")
    aio(main)


def test_connect_timeout_on_a_listener_with_a_full_backlog(aio):
    async def main():
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            fill = [socket.socket() for _ in range(4)]
            for s in fill:  # never accepted: the backlog fills, then SYNs are dropped
                s.setblocking(False)
                s.connect_ex(listener.getsockname())
            started = time.monotonic()
            with pytest.raises(ConnectTimeout):
                await HttpPool().request(f"http://127.0.0.1:{listener.getsockname()[1]}",
                                         "GET", "/", {}, b"", 0.2, 5)
            assert time.monotonic() - started < 1
            for s in fill:
                s.close()
    aio(main)


def test_read_timeout_before_the_head_closes_the_connection(aio):
    async def script(reader, writer, up):
        await up.read(reader)
        up.eof = await reader.read(1)  # b"": the client gave up and closed

    async def main():
        async with Upstream(script) as up:
            with pytest.raises(ReadTimeout):
                await HttpPool().request(up.url, "GET", "/", {}, b"", 1, 0.1)
            await asyncio.sleep(0.05)
            assert up.eof == b""
    aio(main)


def test_an_unread_body_pauses_reading_past_high_water(aio):
    size = 32 * 2**20

    async def script(reader, writer, up):
        await up.read(reader)
        up.transport = writer.transport
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"x" * size)
        await writer.drain()
        await reader.read(1)

    async def main():
        async with Upstream(script) as up:
            conn = await HttpPool().request(up.url, "GET", "/", {}, b"", 1, 1)
            await asyncio.sleep(0.3)
            assert conn._buffered <= HIGH_WATER + 256 * 1024
            assert up.transport.get_write_buffer_size() > size // 2  # the server waits
            assert len(await conn.read(2)) == size
            conn.close()
    aio(main)