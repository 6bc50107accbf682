"""One keep-alive HTTP/1.1 connection to an engine (asyncio protocol + httptools).

Contract: a connection carries one exchange at a time: `send()` a request, then
`head()` (status and headers), then the body by `chunk()` (whatever has arrived,
b"" at its end) or `read()` (all of it). Every failure is an `UpstreamError`;
a connection that failed, or whose answer was not read to its end, is closed,
never reused (`reusable()`). Body bytes beyond `HIGH_WATER` unread pause the
socket, so a slow client slows the engine instead of filling the gateway.
"""

from __future__ import annotations

import asyncio

import httptools

HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """A failed exchange with an engine."""


class ConnectError(UpstreamError):
    """The connection could not be opened."""


class ConnectTimeout(ConnectError):
    pass


class ReadTimeout(UpstreamError):
    """Nothing arrived within the read timeout (before the head, or between chunks)."""


class Disconnected(UpstreamError):
    """The engine closed the connection, or sent something that is not HTTP."""


class _SwitchedProtocols(Exception):
    pass


class Connection(asyncio.Protocol):
    def __init__(self, key: tuple) -> None:
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False   # it served an exchange before this one
        self.idle_since = 0.0
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.got_bytes = False  # any byte of this exchange's answer arrived
        self.complete = False
        self._keep_alive = False
        self.error: UpstreamError | None = None
        self._head = False
        self._interim = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._until_close = False  # no length, not chunked: the body ends with the connection

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop: not a subclass)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:  # (HttpParserUpgrade is one too)
            self._fail(Disconnected(f"malformed answer: {err}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if self._head and self._until_close and exc is None:
                self.complete = True
            else:
                what = "before answering" if not self.got_bytes else "mid-answer"
                self.error = Disconnected(f"connection closed {what}"
                                          + (f": {exc}" if exc else ""))
        self._wake()

    # -- httptools callbacks ---------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        key, val = name.decode("latin-1").lower(), value.decode("latin-1")
        self.headers[key] = self.headers[key] + ", " + val if key in self.headers else val

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status == 101:  # stop parsing: what follows is not HTTP
            self._fail(Disconnected("the engine switched protocols (101)"))
            raise _SwitchedProtocols
        if 100 <= self.status < 200:
            self._interim = True  # (e.g. 103 Early Hints): the real answer follows
            self.headers = {}
            return
        self._head = True
        self._until_close = ("content-length" not in self.headers
                             and "chunked" not in self.headers.get("transfer-encoding", ""))
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._keep_alive = self.parser.should_keep_alive()  # (only valid in a callback)
        self._wake()

    # -- exchange --------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        assert not self.closed and self._waiter is None
        self._reset()
        self.transport.write(data)

    async def head(self, timeout_s: float) -> None:
        while not self._head:
            await self._wait(timeout_s)

    async def chunk(self, timeout_s: float) -> bytes:
        """The body bytes that arrived since the last call (waiting for some);
        b"" once the body is complete."""
        while not self._chunks:
            if self.complete:
                return b""
            await self._wait(timeout_s)
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read(self, timeout_s: float) -> bytes:
        """The rest of the body; `timeout_s` bounds each wait for more of it."""
        parts = []
        while data := await self.chunk(timeout_s):
            parts.append(data)
        return b"".join(parts)

    def reusable(self) -> bool:
        return (self.complete and not self.closed and self.error is None
                and not self._chunks and self._keep_alive)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    async def _wait(self, timeout_s: float) -> None:
        if self.error is not None:
            raise self.error
        self._waiter = waiter = self.loop.create_future()
        # one timer, not asyncio.timeout (~3x the cost, on every read of every request)
        timer = self.loop.call_later(timeout_s, _time_out, waiter, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _fail(self, err: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = err
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _time_out(waiter: asyncio.Future, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout(f"no answer within {timeout_s} s"))
