"""The gateway's HTTP/1.1 server (sluice.gateway.http_server): framing, keep-alive,
request bodies and the answers it gives by itself. Real sockets on loopback;
each test runs on asyncio's loop and on uvloop."""

import asyncio
import functools
import json

import httpx
import pytest
from http_testing import Raw, port_of, request, run_on, serving

from sluice.gateway.http_app import App
from sluice.gateway.http_wire import Response, request_head, response_head


@pytest.fixture(params=["asyncio", "uvloop"])
def aio(request):
    return functools.partial(run_on, request.param)


def echo_app(max_body_bytes: int = 1024) -> App:
    """/echo (GET, POST) answers JSON of what it saw; /slow answers after 0.1 s;
    /boom raises."""
    app = App(max_body_bytes)
    app.state["calls"] = 0

    async def echo(req):
        app.state["calls"] += 1
        return Response(200, json.dumps({"method": req.method, "path": req.path,
                                         "query": req.query, "headers": req.headers,
                                         "body": req.body.decode()}).encode(),
                        {"content-type": "application/json"})

    async def slow(req):
        await asyncio.sleep(0.1)
        return Response(200, b"slow")

    async def boom(req):
        raise RuntimeError("handler bug")

    app.add("GET", "/echo", echo)
    app.add("POST", "/echo", echo)
    app.add("GET", "/slow", slow)
    app.add("GET", "/boom", boom)
    return app


def error_of(answer) -> dict:
    """The OpenAI-shaped error of an answer."""
    assert answer.headers["content-type"] == "application/json"
    err = json.loads(answer.body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_keep_alive_serves_several_requests_on_one_connection(aio):
    async def main():
        async with serving(echo_app()) as server:
            async with httpx.AsyncClient() as client:
                for i in range(3):
                    r = await client.get(f"http://127.0.0.1:{port_of(server)}/echo?i={i}")
                    assert r.status_code == 200 and r.json()["query"] == f"i={i}"
                    assert len(server.connections) == 1
    aio(main)


@pytest.mark.parametrize("version, extra", [("1.1", "connection: close"), ("1.0", "x: y")])
def test_connection_closes_after_the_answer_when_asked(aio, version, extra):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/echo", b"", extra, version=version))
            a = await c.answer()
            assert a.status == 200 and a.headers["connection"] == "close"
            assert await c.rest() == b""
    aio(main)


def test_http10_keep_alive_request_is_kept_open(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            for _ in range(2):
                c.send(request("GET", "/echo", b"", "connection: keep-alive", version="1.0"))
                assert (await c.answer()).status == 200
            c.close()
    aio(main)


def test_pipelined_requests_are_answered_in_order(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/slow") + request("GET", "/echo?second"))
            assert (await c.answer()).body == b"slow"
            assert json.loads((await c.answer()).body)["query"] == "second"
            c.close()
    aio(main)


def test_chunked_request_body_is_read_whole(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                   b"5\r\nhello\r\n")
            await asyncio.sleep(0.02)  # the rest in another segment
            c.send(b"6;ext=1\r\n world\r\n0\r\n\r\n")
            assert json.loads((await c.answer()).body)["body"] == "hello world"
            c.close()
    aio(main)


def test_expect_100_continue_gets_100_then_the_answer(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n"
                   b"expect: 100-continue\r\n\r\n")
            assert (await c.answer()).status == 100
            c.send(b"hi")
            a = await c.answer()
            assert a.status == 200 and json.loads(a.body)["body"] == "hi"
            c.close()
    aio(main)


def test_body_over_limit_by_content_length_is_413_then_close(aio):
    async def main():
        app = echo_app(max_body_bytes=100)
        async with serving(app) as server:
            c = await Raw.open(port_of(server))
            c.send(request("POST", "/echo", b"x" * 101, "expect: 100-continue"))
            a = await c.answer()  # (no 100 Continue first)
            assert a.status == 413 and error_of(a)["code"] == 413
            assert a.headers["connection"] == "close" and await c.rest() == b""
            assert app.state["calls"] == 0
    aio(main)


def test_body_over_limit_by_chunked_stream_is_413_then_close(aio):
    async def main():
        app = echo_app(max_body_bytes=100)
        async with serving(app) as server:
            c = await Raw.open(port_of(server))
            c.send(b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                   + b"40\r\n" + b"x" * 64 + b"\r\n" + b"40\r\n" + b"y" * 64 + b"\r\n")
            a = await c.answer()
            assert a.status == 413 and error_of(a)["type"] == "RequestTooLargeError"
            assert await c.rest() == b"" and app.state["calls"] == 0
    aio(main)


def test_body_at_the_limit_is_accepted(aio):
    async def main():
        async with serving(echo_app(max_body_bytes=100)) as server:
            c = await Raw.open(port_of(server))
            c.send(request("POST", "/echo", b"x" * 100))
            assert (await c.answer()).status == 200
            c.close()
    aio(main)


@pytest.mark.parametrize("garbage", [b"GARBAGE\r\n\r\n", b"GET /echo HTTP/9.9\r\n\r\n",
                                     b"GET /echo HTTP/1.1\nhost: t\n\n"])
def test_malformed_request_is_400_then_close(aio, garbage):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(garbage)
            a = await c.answer()
            assert a.status == 400 and error_of(a)["code"] == 400
            assert await c.rest() == b""
    aio(main)


def test_request_before_a_malformed_one_is_still_answered(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/slow") + b"NOT HTTP\r\n\r\n")
            assert (await c.answer()).body == b"slow"
            assert (await c.answer()).status == 400
            assert await c.rest() == b""
    aio(main)


SMUGGLING = {
    "cl-te": "content-length: 5\r\ntransfer-encoding: chunked",
    "te-cl": "transfer-encoding: chunked\r\ncontent-length: 5",
    "two-cl": "content-length: 5\r\ncontent-length: 6",
    "cl-list": "content-length: 5, 5",
    "te-not-last": "transfer-encoding: chunked, identity",
    "te-unknown": "transfer-encoding: xchunked",
    "te-space": "transfer-encoding : chunked",
}


@pytest.mark.parametrize("framing", SMUGGLING.values(), ids=SMUGGLING.keys())
def test_ambiguous_body_framing_is_refused(aio, framing):
    async def main():
        app = echo_app()
        async with serving(app) as server:
            c = await Raw.open(port_of(server))
            smuggled = request("GET", "/echo?smuggled")
            c.send(f"POST /echo HTTP/1.1\r\nhost: t\r\n{framing}\r\n\r\n".encode()
                   + b"0\r\n\r\n" + smuggled)
            assert (await c.answer()).status == 400
            assert await c.rest() == b"" and app.state["calls"] == 0
    aio(main)


def test_unknown_path_is_404_and_keeps_the_connection(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/nope"))
            a = await c.answer()
            assert a.status == 404 and error_of(a)["code"] == 404 and a.keep_alive
            c.send(request("GET", "/echo"))
            assert (await c.answer()).status == 200
            c.close()
    aio(main)


def test_wrong_method_is_405_with_allow(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("DELETE", "/echo"))
            a = await c.answer()
            assert a.status == 405 and error_of(a)["code"] == 405
            assert a.headers["allow"] == "GET, POST"
            c.close()
    aio(main)


def test_handler_exception_is_500_and_the_connection_stays_usable(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/boom"))
            a = await c.answer()
            assert a.status == 500 and error_of(a)["code"] == 500
            c.send(request("GET", "/echo"))
            assert (await c.answer()).status == 200
            c.close()
    aio(main)


def test_header_names_are_lower_cased_and_repeats_joined(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("GET", "/echo?a=1&b=2", b"", "X-Thing: one", "x-THING: two",
                           "Content-Type: text/plain"))
            seen = json.loads((await c.answer()).body)
            assert seen["headers"]["x-thing"] == "one, two"
            assert seen["headers"]["content-type"] == "text/plain"
            assert seen["path"] == "/echo" and seen["query"] == "a=1&b=2"
            c.close()
    aio(main)


@pytest.mark.parametrize("value", ["a\r\nx-injected: 1", "a\nb", "a\rb"])
def test_a_header_value_with_a_line_break_is_refused(value):
    with pytest.raises(ValueError):
        response_head(200, {"x-v": value}, 0, keep_alive=True)
    with pytest.raises(ValueError):
        request_head("POST", "/v1/completions", "h:1", {"x-v": value}, 0)


def test_response_head_framing():
    head = response_head(200, {"content-type": "a/b"}, None, keep_alive=False)
    assert head.startswith(b"HTTP/1.1 200 OK\r\ndate: ") and head.endswith(b"\r\n\r\n")
    assert b"transfer-encoding: chunked\r\n" in head and b"connection: close\r\n" in head
    plain = response_head(204, {}, 0, keep_alive=True)
    assert b"content-length: 0\r\n" in plain and b"connection" not in plain
    close_delimited = response_head(200, {}, None, keep_alive=False, chunked=False)
    assert b"transfer-encoding" not in close_delimited
    assert b"content-length" not in close_delimited


def test_a_pipelined_expect_100_continue_gets_its_100_after_the_answers_before_it(aio):
    async def main():
        async with serving(echo_app()) as server:
            c = await Raw.open(port_of(server))
            c.send(request("POST", "/echo", b"one") +
                   b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n"
                   b"expect: 100-continue\r\n\r\n")
            first = await c.answer()
            assert first.status == 200 and json.loads(first.body)["body"] == "one"
            assert (await c.answer(timeout_s=0.5)).status == 100  # not the client's own wait
            c.send(b"two")
            a = await c.answer()
            assert a.status == 200 and json.loads(a.body)["body"] == "two"
            c.close()
    aio(main)
