"""Helpers for the tests of the gateway's HTTP layer (http_server, http_client,
http_pool): event loops, an in-process server, raw client connections and
scripted raw upstreams, all on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httptools
import uvloop

from sluice.gateway.http_pool import HttpPool
from sluice.gateway.http_app import App
from sluice.gateway.http_server import HttpServer

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run_on(kind: str, fn: Callable[[], Awaitable], timeout_s: float = 10.0):
    """Run `fn()` on a fresh loop of `kind`, within `timeout_s`. Fails when the
    loop reported an error (an unretrieved task or future exception, an exception
    in a callback), caught after the loop closed and garbage was collected."""
    errors: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        async with asyncio.timeout(timeout_s):
            return await fn()

    gc.freeze()  # what exists already is not this test's: collect only what it made
    try:
        with asyncio.Runner(loop_factory=LOOPS[kind]) as runner:
            result = runner.run(main())
        gc.collect()
    finally:
        gc.unfreeze()
    assert not errors, [e.get("message") for e in errors]
    return result


def port_of(server: HttpServer | asyncio.Server) -> int:
    s = server._server if isinstance(server, HttpServer) else server
    return s.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def serving(app: App, keepalive_s: float = 5.0, grace_s: float = 1.0):
    """An HttpServer of `app` on a free loopback port, stopped on exit."""
    server = HttpServer(app, keepalive_s=keepalive_s, grace_s=grace_s)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop()


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | bytearray = b""
    keep_alive: bool = False


class _Parse:
    """httptools callbacks collecting whole answers."""

    def __init__(self) -> None:
        self.done: deque[Answer] = deque()
        self.cur = Answer()
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.cur = Answer(body=bytearray())

    def on_header(self, name: bytes, value: bytes) -> None:
        k, v = name.decode().lower(), value.decode()
        self.cur.headers[k] = self.cur.headers[k] + ", " + v if k in self.cur.headers else v

    def on_headers_complete(self) -> None:
        self.cur.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.cur.body += body

    def on_message_complete(self) -> None:
        self.cur.keep_alive = self.parser.should_keep_alive()
        self.cur.body = bytes(self.cur.body)
        self.done.append(self.cur)


class Raw:
    """A client connection that sends exact bytes and parses what comes back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.received = bytearray()  # everything that arrived, for framing checks
        self._parse = _Parse()

    @classmethod
    async def open(cls, port: int, rcvbuf: int | None = None) -> Raw:
        """`rcvbuf`: a small socket receive buffer (and stream limit), so that not
        reading soon stops the server's sends."""
        if rcvbuf is None:
            return cls(*await asyncio.open_connection("127.0.0.1", port))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return cls(*await asyncio.open_connection(sock=sock, limit=rcvbuf))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answer(self, timeout_s: float = 5.0) -> Answer:
        """The next whole answer (a 1xx counts as one)."""
        async with asyncio.timeout(timeout_s):
            while not self._parse.done:
                data = await self.reader.read(65536)
                assert data, f"closed before a whole answer; got {self.received[-300:]!r}"
                self.received += data
                self._parse.parser.feed_data(data)
        return self._parse.done.popleft()

    async def rest(self, timeout_s: float = 5.0) -> bytes:
        """Everything until the server closes (raw, unparsed)."""
        async with asyncio.timeout(timeout_s):
            data = await self.reader.read()
        self.received += data
        return data

    async def is_open(self, wait_s: float) -> bool:
        """True when nothing (no byte, no EOF) arrives within `wait_s`."""
        try:
            async with asyncio.timeout(wait_s):
                data = await self.reader.read(1)
        except TimeoutError:
            return True
        self.received += data
        return False

    def close(self) -> None:
        self.writer.close()


def request(method: str, path: str, body: bytes = b"", *extra: str,
            version: str = "1.1") -> bytes:
    """Bytes of one request with a content-length (for a body) and `extra` header lines."""
    lines = [f"{method} {path} HTTP/{version}", "host: t", *extra]
    if body:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# -- scripted upstreams, for the client and pool --------------------------------------------

async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and content-length body); b"" when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


class Upstream:
    """A raw HTTP server run by `script(reader, writer, upstream)` per connection;
    records each connection's client port and each request."""

    def __init__(self, script) -> None:
        self.script = script
        self.peers: list[int] = []
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _serve(self, reader, writer) -> None:
        self.peers.append(writer.get_extra_info("peername")[1])
        try:
            await self.script(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # (cancelled: the test's loop closes; streams would log a cancelled task)
        finally:
            writer.close()

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        req = await read_request(reader)
        if req:
            self.requests.append(req)
        return req

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port_of(self.server)}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def answer_each(reader, writer, up: Upstream, answer: bytes = OK) -> None:
    """A keep-alive upstream script: `answer` to every request."""
    while await up.read(reader):
        writer.write(answer)
        await writer.drain()


async def fetch(pool: HttpPool, url: str, read_timeout_s: float = 2.0) -> bytes:
    """POST through `pool`, read the whole body, release the connection."""
    conn = await pool.request(url, "POST", "/v1/completions", {}, b"{}", 1.0, read_timeout_s)
    body = await conn.read(read_timeout_s)
    pool.release(conn)
    return body
