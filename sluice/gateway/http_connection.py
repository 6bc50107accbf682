"""One client connection of the gateway's HTTP server (`http_server` states
what it does): parsing with httptools, answering in order, timers, flow control."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

import httptools

from sluice.gateway.errors import error_response
from sluice.gateway.http_app import Request
from sluice.gateway.http_wire import Response, response_head

if TYPE_CHECKING:
    from sluice.gateway.http_server import HttpServer

log = logging.getLogger("sluice.gateway.http")

MAX_PIPELINED = 16  # queued requests on one connection before reading pauses
MAX_HEAD_BYTES = 64 * 1024  # request line and headers (431 beyond), plus one read
LINGER_S = 2.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Reject:
    """A request refused by the server itself, answered in its turn, then close."""

    def __init__(self, status: int, message: str) -> None:
        self.response = error_response(status, message)


class Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | _Reject] = deque()
        self.task: asyncio.Task | None = None
        self.closed = False
        self._broken = False  # input refused: what follows is read and dropped
        self._reading = True
        self._drain_waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._in_head = False  # a request line or headers are being read
        self._began_now = False  # ... since the current read
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        self._continue_owed = False  # a 100 Continue, due once the answers before it went

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop: not a subclass)
        self.server.connections.add(self)
        self._arm(self.server.keepalive_s)

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        self._began_now = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as err:
            self._refuse(400, f"malformed HTTP request: {err}")
        # httptools buffers a header until its line ends: count what arrives while a
        # head is incomplete (from the read after the one it began in)
        if self._in_head and not self._began_now:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._arm(None)
        if self.task is not None:
            self.task.cancel()  # the client left: its handler (and upstream call) stops
        self.resume_writing()  # (drain() then sees `closed`)

    def pause_writing(self) -> None:
        if self._drain_waiter is None:
            self._drain_waiter = self.loop.create_future()

    def resume_writing(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", {}, [], 0
        self._in_head, self._began_now, self._head_bytes = True, True, 0
        self._too_large = self._continue_owed = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key, val = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[key] = self._headers[key] + ", " + val if key in self._headers else val

    def on_headers_complete(self) -> None:
        self._in_head = False
        declared = self._headers.get("content-length")
        if declared is not None and int(declared) > self.app.max_body_bytes:
            self._too_large = True
            self._refuse(413, f"request body over {self.app.max_body_bytes} bytes")
        elif self._headers.get("expect", "").lower() == "100-continue":
            if self.task is None and not self.queue:
                self.write(_CONTINUE)
            else:  # pipelined: never inside another answer, but after them (see _run)
                self._continue_owed = True

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._size += len(body)
        if self._size > self.app.max_body_bytes:
            self._too_large = True
            self._refuse(413, f"request body over {self.app.max_body_bytes} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._continue_owed = False  # (the body came without it)
        if self._broken:
            return
        p = self.parser
        if p.should_upgrade():  # (httptools raises HttpParserUpgrade next)
            self._refuse(400, "protocol upgrades are not supported")
            return
        self._arm(None)  # a whole request came: no idle close while it is answered
        self._enqueue(Request(self, p.get_method().decode(), self._url, self._headers,
                              b"".join(self._body), p.should_keep_alive(),
                              p.get_http_version() == "1.0"))

    # -- answering ---------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closed or self.transport.is_closing():
            raise ConnectionResetError("client disconnected")
        self.transport.write(data)

    async def drain(self) -> None:
        """Wait while the client reads slower than we write; ConnectionResetError
        once it is gone, or when it read nothing for `write_timeout_s`."""
        if self._drain_waiter is not None:
            try:
                async with asyncio.timeout(self.server.write_timeout_s):
                    await asyncio.shield(self._drain_waiter)
            except TimeoutError:
                self.transport.abort()  # it stopped reading: free its handler
                raise ConnectionResetError("client stopped reading") from None
        if self.closed:
            raise ConnectionResetError("client disconnected")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` after what is queued, then close (input is dropped)."""
        if not self._broken:
            self._broken = True
            self._enqueue(_Reject(status, message))

    def _enqueue(self, item: Request | _Reject) -> None:
        self.queue.append(item)
        if self.task is None:
            self.task = self.loop.create_task(self._run())
        if len(self.queue) >= MAX_PIPELINED and self._reading:
            self._reading = False
            self.transport.pause_reading()

    async def _run(self) -> None:
        try:
            while self.queue and not self.closed:
                item = self.queue.popleft()
                if not self._reading and len(self.queue) < MAX_PIPELINED // 2:
                    self._reading = True
                    self.transport.resume_reading()
                if isinstance(item, _Reject):
                    self.app.on_reject(item.response.status)
                    self._send(item.response, keep_alive=False)
                    self._linger()
                    return
                if not await self._answer(item):
                    self.transport.close()
                    return
                if self._continue_owed and not self.queue and not self._broken:
                    self._continue_owed = False
                    self.write(_CONTINUE)
        except ConnectionResetError:
            pass
        finally:
            self.task = None
            if not self.closed and not self.queue and not self._broken:
                self._arm(self.server.keepalive_s)

    async def _answer(self, req: Request) -> bool:
        """Run the request's handler and send its answer; False: close the connection."""
        if self.server.stopping:
            req.keep_alive = False
        methods = self.app.routes.get(req.path)
        handler = methods.get(req.method) if methods else None
        if handler is None:
            resp = (error_response(404, f"no route {req.path}") if not methods else
                    error_response(405, f"method {req.method} not allowed on {req.path}",
                                   headers={"allow": ", ".join(methods)}))
            self.app.on_reject(resp.status)
        else:
            try:
                resp = await handler(req)
                if resp is None and req._stream is None:
                    raise RuntimeError("the handler neither answered nor streamed")
            except Exception as err:  # noqa: BLE001 -- a bug must still answer like the API
                if isinstance(err, ConnectionResetError) and (
                        self.closed or self.transport.is_closing()):
                    return False  # the client left (or was cut for not reading)
                log.exception("internal error on %s %s", req.method, req.path)
                self.app.on_reject(500)
                if req._stream is not None:
                    return False  # an answer already began: cut it
                resp = error_response(500, "internal gateway error")
        if req._stream is not None:
            return req._stream.ended and req.keep_alive
        req.keep_alive = req.keep_alive and not self.server.stopping
        try:
            self._send(resp, req.keep_alive, head_only=req.method == "HEAD")
        except (ValueError, TypeError, UnicodeEncodeError):  # not sendable
            log.exception("unsendable answer to %s %s", req.method, req.path)
            self.app.on_reject(500)
            self._send(error_response(500, "internal gateway error"),
                       req.keep_alive)
        await self.drain()  # pipelined answers wait for the client to read
        return req.keep_alive

    def _send(self, resp: Response, keep_alive: bool, head_only: bool = False) -> None:
        head = response_head(resp.status, resp.headers, len(resp.body), keep_alive)
        self.write(head if head_only else head + resp.body)

    def _linger(self) -> None:
        """Close after a refusal without losing the answer: end our side, then read
        (and drop) what the client still sends for up to LINGER_S; closing with
        unread input would reset the connection, and the client could lose the
        answer before reading it."""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if not self._reading:
            self._reading = True
            self.transport.resume_reading()
        self._arm(LINGER_S)

    def _arm(self, delay_s: float | None) -> None:
        """(Re)start the close timer: `keepalive_s` while the connection waits for a
        whole request, LINGER_S after a refusal; None stops it."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if delay_s is None else self.loop.call_later(delay_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.task is None and not self.closed:
            if self._broken:
                self.transport.abort()  # (lingered long enough)
            else:
                self.transport.close()
