"""The gateway's HTTP/1.1 server: an asyncio protocol over httptools' llhttp parser.

Why not aiohttp's server (which served the gateway before): at 200 requests/s on
the 2-vCPU dev machine its layers cost ~0.3 ms of CPU per proxied request, as
much as everything else the gateway does; this serves the same path in a
fraction of that (docs/benchmarks.md, gateway overhead). It does only what the
gateway needs:

- HTTP/1.1 keep-alive (HTTP/1.0 without keep-alive, and `Connection: close`,
  close after the answer); pipelined requests are answered in order.
- Request bodies (content-length or chunked) are read whole before the handler
  runs, at most `max_body_bytes` (413, then close); `Expect: 100-continue` is
  answered.
- Routes by exact path: unknown path 404, wrong method 405 with `Allow`, a
  malformed request 400 (then close); all OpenAI-shaped.
- Answers are whole (`Response`) or streamed (`Request.stream()`: chunked
  transfer coding, or close-delimited for HTTP/1.0), with write flow control.
- A client disconnect cancels the running handler (so it closes its upstream
  request); an exception in a handler is a 500, or a cut connection if its
  answer had begun.
- An idle connection closes after `keepalive_s`; `stop()` stops listening,
  lets running handlers finish for `grace_s`, then cancels them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
import httptools

from sluice.gateway.errors import error_response
from sluice.gateway.http_app import App, Request
from sluice.gateway.http_wire import response_head

log = logging.getLogger("sluice.gateway.http")

MAX_PIPELINED = 16  # queued requests on one connection before reading pauses


class _Reject:
    """A request refused by the server itself, answered in its turn, then close."""

    def __init__(self, status: int, message: str, code: str) -> None:
        self.response = error_response(status, message, code)


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | _Reject] = deque()
        self.task: asyncio.Task | None = None
        self.closed = False
        self._broken = False  # input refused: everything after it is ignored
        self._reading = True
        self._drain_waiter: asyncio.Future | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop: not a subclass)
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported", "invalid_request")
        except httptools.HttpParserError as err:
            self._refuse(400, f"malformed HTTP request: {err}", "invalid_request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        if self.task is not None:
            self.task.cancel()  # the client left: its handler (and upstream call) stops
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("client disconnected"))

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
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key, val = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[key] = self._headers[key] + ", " + val if key in self._headers else val

    def on_headers_complete(self) -> None:
        declared = self._headers.get("content-length")
        if declared is not None and int(declared) > self.app.max_body_bytes:
            self._too_large = True
            self._refuse(413, f"request body over {self.app.max_body_bytes} bytes",
                         "body_too_large")
        elif (self._headers.get("expect", "").lower() == "100-continue"
              and self.task is None and not self.queue):  # (never inside another answer)
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._size += len(body)
        if self._size > self.app.max_body_bytes:
            self._too_large = True
            self._refuse(413, f"request body over {self.app.max_body_bytes} bytes",
                         "body_too_large")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._broken:
            return
        p = self.parser
        self._enqueue(Request(self, p.get_method().decode(), self._url, self._headers,
                              b"".join(self._body), p.should_keep_alive(),
                              p.get_http_version() == "1.0"))

    # -- answering ---------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closed or self.transport.is_closing():
            raise ConnectionResetError("client disconnected")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._drain_waiter is not None:
            await asyncio.shield(self._drain_waiter)
        elif self.closed:
            raise ConnectionResetError("client disconnected")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` after what is queued, then close; stop reading."""
        self._broken = True
        self.transport.pause_reading()
        self._enqueue(_Reject(status, message, code))

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
                if not self._reading and not self._broken and len(self.queue) < MAX_PIPELINED // 2:
                    self._reading = True
                    self.transport.resume_reading()
                if isinstance(item, _Reject):
                    self.app.on_reject(item.response.status)
                    self.write(response_head(item.response.status, item.response.headers,
                                             len(item.response.body), keep_alive=False)
                               + item.response.body)
                    self.transport.close()
                    return
                if not await self._answer(item):
                    self.transport.close()
                    return
        except ConnectionResetError:
            pass
        finally:
            self.task = None
            if not self.closed and not self.queue:
                self._arm_idle()

    async def _answer(self, req: Request) -> bool:
        """Run the request's handler and send its answer; False: close the connection."""
        methods = self.app.routes.get(req.path)
        handler = methods.get(req.method) if methods else None
        if handler is None:
            resp = (error_response(404, f"no route {req.path}", "not_found") if not methods else
                    error_response(405, f"method {req.method} not allowed on {req.path}",
                                   "method_not_allowed", headers={"allow": ", ".join(methods)}))
            self.app.on_reject(resp.status)
        else:
            try:
                resp = await handler(req)
            except ConnectionResetError:
                raise
            except Exception:  # noqa: BLE001 -- a bug must still answer like the API
                log.exception("internal error on %s %s", req.method, req.path)
                if req._stream is not None:
                    return False  # an answer already began: cut it
                resp = error_response(500, "internal gateway error", "internal_error")
        if req._stream is not None:
            return req._stream.ended and req.keep_alive
        assert resp is not None, "a handler returns a Response unless it streamed"
        self.write(response_head(resp.status, resp.headers, len(resp.body), req.keep_alive)
                   + resp.body)
        return req.keep_alive

    def _arm_idle(self) -> None:
        self._idle = self.loop.call_later(self.server.keepalive_s, self._close_idle)

    def _close_idle(self) -> None:
        self._idle = None
        if self.task is None and not self.closed:
            self.transport.close()


class HttpServer:
    def __init__(self, app: App, keepalive_s: float = 75.0, grace_s: float = 10.0) -> None:
        assert keepalive_s > 0 and grace_s >= 0
        self.app = app
        self.keepalive_s = keepalive_s
        self.grace_s = grace_s
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        for hook in self.app.on_startup:
            await hook()
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), host, port, backlog=2048, reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.task is None:
                conn.transport.close()
        deadline = asyncio.get_running_loop().time() + self.grace_s
        while any(c.task is not None for c in self.connections):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.transport.close()  # cancels what still runs
        await asyncio.sleep(0)
        for hook in self.app.on_cleanup:
            await hook()


def serve(app: App, host: str, port: int) -> None:
    """Serve `app` until SIGINT / SIGTERM, on uvloop when it is installed."""
    import signal

    async def main() -> None:
        server = HttpServer(app)
        await server.start(host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(main())
