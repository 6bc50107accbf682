"""The gateway's HTTP/1.1 server (sluice.gateway.http_server): streamed answers,
write flow control, client disconnects, the idle timeout and stop(). Real
sockets on loopback; each test runs on asyncio's loop and on uvloop."""

import asyncio
import functools
import time

import pytest
from http_testing import Raw, port_of, request, run_on, serving

from sluice.gateway.http_app import App
from sluice.gateway.http_connection import MAX_PIPELINED
from sluice.gateway.http_server import HttpServer
from sluice.gateway.http_wire import Response


@pytest.fixture(params=["asyncio", "uvloop"])
def aio(request):
    return functools.partial(run_on, request.param)


def app_with(**handlers) -> App:
    """GET /<name> for each handler."""
    app = App(1024)
    for name, handler in handlers.items():
        app.add("GET", f"/{name}", handler)
    return app


async def hello_stream(req):
    out = req.stream(200, {"content-type": "text/plain"})
    await out.write(b"hello")
    await out.write(b"")  # nothing: no (terminal) empty chunk
    await out.write(b" world!")
    out.end()


async def ok(req):
    return Response(200, b"ok")


def test_streamed_answer_is_chunked_and_keeps_the_connection(aio):
    async def main():
        async with serving(app_with(s=hello_stream, ok=ok)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/s"))
            a = await c.answer()
            assert a.body == b"hello world!" and a.headers["transfer-encoding"] == "chunked"
            assert c.received.endswith(b"\r\n\r\n5\r\nhello\r\n7\r\n world!\r\n0\r\n\r\n")
            c.send(request("GET", "/ok"))
            assert (await c.answer()).body == b"ok"
            c.close()
    aio(main)


def test_streamed_answer_to_http10_is_close_delimited(aio):
    async def main():
        async with serving(app_with(s=hello_stream)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/s", b"", "connection: keep-alive", version="1.0"))
            data = await c.rest()
            head, body = data.split(b"\r\n\r\n", 1)
            assert b"transfer-encoding" not in head and b"content-length" not in head
            assert b"connection: close" in head and body == b"hello world!"
    aio(main)


def test_exception_after_the_stream_began_cuts_the_connection(aio):
    async def broken(req):
        out = req.stream(200, {})
        await out.write(b"partial")
        raise RuntimeError("mid-stream bug")

    async def main():
        async with serving(app_with(b=broken)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/b"))
            data = await c.rest()
            assert data.endswith(b"7\r\npartial\r\n") and b"0\r\n\r\n" not in data
    aio(main)


def test_unended_stream_is_cut(aio):
    async def unended(req):
        await req.stream(200, {}).write(b"abc")

    async def main():
        async with serving(app_with(u=unended)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/u"))
            assert (await c.rest()).endswith(b"3\r\nabc\r\n")
    aio(main)


def test_client_disconnect_cancels_the_handler(aio):
    seen = []

    async def waits(req):
        seen.append("started")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main():
        async with serving(app_with(w=waits)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/w"))
            while not seen:
                await asyncio.sleep(0.01)
            c.close()
            for _ in range(100):
                if "cancelled" in seen and not server.connections:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(seen)
    aio(main)


def test_write_after_the_client_left_raises_connection_reset(aio):
    got = asyncio.Queue()

    async def keeps_writing(req):
        out = req.stream(200, {})
        await out.write(b"first")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # the client left; a write now must fail
            try:
                await out.write(b"more")
            except ConnectionResetError as err:
                got.put_nowait(err)
            raise

    async def main():
        async with serving(app_with(k=keeps_writing)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/k"))
            await c.reader.readuntil(b"first\r\n")
            c.close()
            async with asyncio.timeout(2):
                assert isinstance(await got.get(), ConnectionResetError)
    aio(main)


def test_stream_writes_wait_for_a_slow_reader(aio):
    """50 MB streamed to a client that reads late: the writes block, the
    transport's buffer stays bounded, and every byte arrives."""
    chunk, n = b"x" * 262144, 200
    state = {"written": 0, "max_buffer": 0}

    async def big(req):
        out = req.stream(200, {})
        transport = req._conn.transport
        for _ in range(n):
            await out.write(chunk)
            state["written"] += len(chunk)
            state["max_buffer"] = max(state["max_buffer"], transport.get_write_buffer_size())
        out.end()

    async def main():
        async with serving(app_with(big=big)) as server:
            c = await Raw.open(port_of(server), rcvbuf=65536)
            c.send(request("GET", "/big"))
            await asyncio.sleep(0.3)  # not reading: the handler must be blocked
            assert state["written"] < 10 * 2**20
            a = await c.answer(timeout_s=8)
            assert len(a.body) == len(chunk) * n and state["max_buffer"] < 2 * 2**20
            c.close()
    aio(main)


def test_reading_pauses_while_too_many_pipelined_requests_wait(aio):
    release = asyncio.Event()

    async def gated(req):
        await release.wait()
        return Response(200, req.query.encode())

    async def main():
        async with serving(app_with(g=gated)) as server:
            c = await Raw.open(port_of(server))
            n = MAX_PIPELINED + 8
            for i in range(n):  # one segment each
                c.send(request("GET", f"/g?{i}"))
                await c.writer.drain()
                await asyncio.sleep(0.005)
            (conn,) = server.connections
            assert not conn.transport.is_reading() and len(conn.queue) < n - 1
            release.set()
            assert [(await c.answer()).body for _ in range(n)] == [b"%d" % i for i in range(n)]
            assert conn.transport.is_reading()
            c.close()
    aio(main)


def test_idle_connection_closes_after_keepalive_s(aio):
    async def main():
        async with serving(app_with(ok=ok), keepalive_s=0.2) as server:
            silent = await Raw.open(port_of(server))
            used = await Raw.open(port_of(server))
            used.send(request("GET", "/ok"))
            assert (await used.answer()).status == 200
            started = time.monotonic()
            assert await silent.rest(timeout_s=2) == b"" and await used.rest(timeout_s=2) == b""
            assert 0.1 < time.monotonic() - started < 1.5
    aio(main)


def test_a_running_handler_outlives_keepalive_s(aio):
    async def slow(req):
        await asyncio.sleep(0.4)
        return Response(200, b"late")

    async def main():
        async with serving(app_with(s=slow), keepalive_s=0.1) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/s"))
            assert (await c.answer()).body == b"late"
            c.close()
    aio(main)


def test_stop_lets_a_running_handler_finish_and_closes_idle_connections(aio):
    release = asyncio.Event()

    async def slow(req):
        await release.wait()
        return Response(200, b"finished")

    async def main():
        app = app_with(s=slow)
        cleaned = []

        async def cleanup():
            cleaned.append(True)
        app.on_cleanup.append(cleanup)
        server = HttpServer(app, keepalive_s=5, grace_s=3)
        await server.start("127.0.0.1", 0)
        port = port_of(server)
        idle, busy = await Raw.open(port), await Raw.open(port)
        busy.send(request("GET", "/s"))
        await asyncio.sleep(0.05)
        stopping = asyncio.create_task(server.stop())
        assert await idle.rest(timeout_s=1) == b""  # closed at once
        await asyncio.sleep(0.1)
        assert not stopping.done()
        release.set()
        assert (await busy.answer()).body == b"finished"
        async with asyncio.timeout(1):
            await stopping
        assert cleaned and not server.connections
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
    aio(main)


def test_stop_cancels_a_handler_still_running_after_grace_s(aio):
    seen = []

    async def stuck(req):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main():
        server = HttpServer(app_with(s=stuck), keepalive_s=5, grace_s=0.2)
        await server.start("127.0.0.1", 0)
        c = await Raw.open(port_of(server))
        c.send(request("GET", "/s"))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await server.stop()
        assert time.monotonic() - started < 1
        assert await c.rest(timeout_s=1) == b""
        await asyncio.sleep(0.01)
        assert seen == ["cancelled"]
    aio(main)

