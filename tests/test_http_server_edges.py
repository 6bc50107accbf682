"""Edge cases of the gateway's HTTP/1.1 server (HEAD, stalled and oversized requests,
unread pipelined answers, unsendable answers, upgrades, refusals to a client still
sending, shutdown), each once a fault found in review."""

import asyncio
import functools
import json
import time

import httpx
import pytest
from http_testing import Raw, port_of, request, run_on, serving

from sluice.gateway.http_app import App
from sluice.gateway.http_server import HttpServer
from sluice.gateway.http_wire import Response


@pytest.fixture(params=["asyncio", "uvloop"])
def aio(request):
    return functools.partial(run_on, request.param)


def app_with(max_body_bytes: int = 1024, **handlers) -> App:
    """GET and POST /<name> for each handler."""
    app = App(max_body_bytes)
    for name, handler in handlers.items():
        app.add("GET", f"/{name}", handler)
        app.add("POST", f"/{name}", handler)
    return app


async def echo(req):
    return Response(200, json.dumps({"body": req.body.decode()}).encode())


def test_head_answer_has_no_body(aio):
    async def main():
        async with serving(app_with(echo=echo)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("HEAD", "/nope", b"", "connection: close"))
            data = await c.rest()
            assert data.startswith(b"HTTP/1.1 404") and data.endswith(b"\r\n\r\n")
    aio(main)


def test_stalled_partial_request_is_closed(aio):
    async def main():
        async with serving(app_with(echo=echo), keepalive_s=0.2) as server:
            c = await Raw.open(port_of(server))
            c.send(b"GET /echo HTTP/1.1\r\nhost: t\r\n")  # ... and nothing more
            assert not await c.is_open(0.6)
    aio(main)


def test_oversized_request_head_is_refused(aio):
    async def main():
        async with serving(app_with(echo=echo)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/echo", b"", "x-big: " + "a" * 2**20))
            a = await c.answer()
            assert a.status in (400, 431) and await c.rest() == b""
    aio(main)


def test_a_header_line_that_never_ends_is_refused(aio):
    async def main():
        async with serving(app_with(echo=echo)) as server:
            c = await Raw.open(port_of(server))
            c.send(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: ")
            for _ in range(40):  # 160 KiB in separate reads, no line end
                c.send(b"a" * 4096)
                await asyncio.sleep(0.002)
            a = await c.answer()
            assert a.status == 431 and json.loads(a.body)["error"]["code"] == 431
    aio(main)


def test_pipelined_whole_answers_wait_for_the_reader(aio):
    async def big(req):
        return Response(200, b"z" * 2**20)

    async def main():
        async with serving(app_with(big=big)) as server:
            c = await Raw.open(port_of(server), rcvbuf=65536)
            c.send(request("GET", "/big") * 32)
            await asyncio.sleep(0.3)
            (conn,) = server.connections
            assert conn.transport.get_write_buffer_size() < 4 * 2**20
            for _ in range(32):
                assert len((await c.answer()).body) == 2**20
            c.close()
    aio(main)


async def bad_header(req):
    return Response(200, b"x", {"x-bad": "a\r\nb"})


async def no_answer(req):
    return None


async def str_body(req):
    return Response(200, "not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("handler", [bad_header, no_answer, str_body])
def test_an_unwritable_handler_answer_is_a_500(aio, handler):
    async def main():
        async with serving(app_with(h=handler)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/h"))
            assert (await c.answer(timeout_s=0.5)).status == 500
            c.close()
    aio(main)


def test_connection_reset_error_from_a_handler_does_not_hang_the_client(aio):
    async def resets(req):
        raise ConnectionResetError("some other socket")

    async def main():
        async with serving(app_with(r=resets)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/r"))
            assert not await c.is_open(0.5)
            c.close()
    aio(main)


def test_upgrade_request_gets_exactly_one_answer(aio):
    async def main():
        async with serving(app_with(echo=echo)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("POST", "/echo", b"abc", "connection: Upgrade, HTTP2-Settings",
                           "upgrade: h2c", "http2-settings: AAMAAABkAAQAAP__"))
            data = await c.rest()
            assert data.count(b"HTTP/1.1 ") == 1 and b'"body": ""' not in data
    aio(main)


def test_413_reaches_a_client_still_sending_its_body(aio):
    async def main():
        async with serving(app_with(echo=echo)) as server:
            async with httpx.AsyncClient() as client:
                r = await client.post(f"http://127.0.0.1:{port_of(server)}/echo",
                                      content=b"x" * (16 * 2**20))
                assert r.status_code == 413
    aio(main)


def endless_stream(seen: list[str]):
    """A handler streaming 64 KiB chunks until it is stopped; `seen` gets the name
    of what stopped it."""
    async def endless(req):
        out = req.stream(200, {})
        try:
            while True:
                await out.write(b"q" * 65536)
        except (ConnectionResetError, asyncio.CancelledError) as err:
            seen.append(type(err).__name__)
            raise
    return endless


async def streaming_to_a_small_buffer(handler, **server_kw) -> tuple[HttpServer, Raw]:
    """A started server streaming `handler`'s answer to a client with a 4 KiB receive
    buffer that asked for it and reads nothing."""
    server = HttpServer(app_with(s=handler), **server_kw)
    await server.start("127.0.0.1", 0)
    c = await Raw.open(port_of(server), rcvbuf=4096)
    c.send(request("GET", "/s"))
    return server, c


def test_stop_cuts_a_stream_to_a_client_that_does_not_read(aio):
    seen = []
    endless = endless_stream(seen)

    async def main():
        server, c = await streaming_to_a_small_buffer(endless, grace_s=0.1)
        await asyncio.sleep(0.2)
        await server.stop()
        await asyncio.sleep(0.5)
        assert seen == ["CancelledError"] and not server.connections
        c.close()
    aio(main)


def test_stop_cleans_up_after_the_cancelled_handlers_finished(aio):
    events = []

    async def stuck(req):
        try:
            await asyncio.sleep(30)
        finally:
            events.append("handler done")

    async def main():
        app = app_with(s=stuck)

        async def cleanup():
            events.append("cleanup")
        app.on_cleanup.append(cleanup)
        server = HttpServer(app, grace_s=0.1)
        await server.start("127.0.0.1", 0)
        c = await Raw.open(port_of(server))
        c.send(request("GET", "/s"))
        await asyncio.sleep(0.05)
        await server.stop()
        await asyncio.sleep(0.05)
        assert events == ["handler done", "cleanup"]
        c.close()
    aio(main)


def test_client_leaving_a_large_whole_answer_logs_no_loop_error(aio):
    async def big(req):
        return Response(200, b"z" * (8 * 2**20))

    async def main():
        async with serving(app_with(big=big)) as server:
            c = await Raw.open(port_of(server), rcvbuf=4096)
            c.send(request("GET", "/big", b"", "connection: close"))
            await asyncio.sleep(0.2)
            c.close()
            await asyncio.sleep(0.2)
    aio(main)  # run_on fails on the loop's error report


def test_a_client_that_stops_reading_is_cut_after_write_timeout_s(aio, caplog):
    seen = []
    flood = endless_stream(seen)

    async def main():
        server, c = await streaming_to_a_small_buffer(flood, write_timeout_s=0.3)
        deadline = time.monotonic() + 3
        while not (seen and not server.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert seen and not server.connections
        c.close()
        await server.stop()
    aio(main)
    assert "internal error" not in caplog.text  # a client cut, not a gateway bug


def test_answers_during_stop_close_their_connection(aio):
    release = asyncio.Event()

    async def slow(req):
        await release.wait()
        return Response(200, b"finished")

    async def main():
        server = HttpServer(app_with(s=slow), keepalive_s=5, grace_s=3)
        await server.start("127.0.0.1", 0)
        busy = await Raw.open(port_of(server))
        busy.send(request("GET", "/s"))
        await asyncio.sleep(0.05)
        stopping = asyncio.create_task(server.stop())
        await asyncio.sleep(0.05)
        release.set()
        a = await busy.answer()
        assert a.body == b"finished" and a.headers.get("connection") == "close"
        assert await busy.rest(timeout_s=1) == b""
        await stopping
    aio(main)
