"""What the gateway's HTTP server hands its handlers: the `App` (routes, hooks), each
`Request`, and a `StreamWriter` for answers sent as they are produced. The
connection behind them is `http_server.Connection` (`write`, `drain`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from sluice.gateway.http_wire import Response, response_head

Handler = Callable[["Request"], Awaitable[Response | None]]


class _Conn(Protocol):
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...


class App:
    """Routes and lifecycle hooks. `on_reject(status)` is told of every request
    refused before a handler saw it (400, 404, 405, 413, 431) and of every
    internal error answered 500 (a handler's bug)."""

    def __init__(self, max_body_bytes: int) -> None:
        assert max_body_bytes > 0
        self.max_body_bytes = max_body_bytes
        self.routes: dict[str, dict[str, Handler]] = {}
        self.on_startup: list[Callable[[], Awaitable[None]]] = []
        self.on_cleanup: list[Callable[[], Awaitable[None]]] = []
        self.on_reject: Callable[[int], None] = lambda status: None
        self.state: dict[str, Any] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.routes.setdefault(path, {})[method] = handler


class Request:
    """One parsed request. `headers` has lower-case names (repeats joined by ", ")."""

    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "http10",
                 "_conn", "_stream")

    def __init__(self, conn: _Conn, method: str, url: bytes, headers: dict[str, str],
                 body: bytes, keep_alive: bool, http10: bool) -> None:
        path, _, query = url.decode("latin-1").partition("?")
        self.method, self.path, self.query = method, path, query
        self.headers, self.body = headers, body
        self.keep_alive, self.http10 = keep_alive, http10
        self._conn = conn
        self._stream: StreamWriter | None = None

    def stream(self, status: int, headers: dict[str, str]) -> StreamWriter:
        """Start a streamed answer (its head is written now). The handler must
        `end()` it; one it leaves unended is cut (the connection closes), so the
        client can tell a truncated answer from a complete one."""
        assert self._stream is None, "one answer per request"
        if self.http10:
            self.keep_alive = False  # no chunked coding: the body ends with the connection
        head = response_head(status, headers, None, self.keep_alive, chunked=not self.http10)
        self._stream = StreamWriter(self._conn, chunked=not self.http10)  # (head was valid)
        self._conn.write(head)
        return self._stream


class StreamWriter:
    def __init__(self, conn: _Conn, chunked: bool) -> None:
        self._conn = conn
        self._chunked = chunked
        self.ended = False

    async def write(self, data: bytes) -> None:
        """Send `data` as it is (one chunk); waits while the client reads slower
        than we write. Raises ConnectionResetError once the client is gone."""
        assert not self.ended
        if data:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
            await self._conn.drain()

    def end(self) -> None:
        assert not self.ended
        self.ended = True
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
