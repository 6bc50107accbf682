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
  answered (on a pipelined request, once the answers before it are sent).
- Routes by exact path: unknown path 404, wrong method 405 with `Allow`, a
  malformed request or a protocol upgrade 400 (then close); all OpenAI-shaped.
- Answers are whole (`Response`) or streamed (`Request.stream()`: chunked
  transfer coding, or close-delimited for HTTP/1.0), with write flow control.
- A client disconnect cancels the running handler (so it closes its upstream
  request); an exception in a handler is a 500, or a cut connection if its
  answer had begun.
- A connection without a whole request for `keepalive_s` closes (idle, or
  stalled mid-request); a request head is at most MAX_HEAD_BYTES (431);
  after a refusal the connection lingers, reading and dropping input, so the
  client gets the answer before the close. HEAD answers carry no body.
- A client that reads nothing of a pending answer for `write_timeout_s` is cut
  (its handler cancelled).
- `stop()` stops listening, lets running handlers finish for `grace_s` (their
  answers close the connection), then cancels them and waits for them before
  the cleanup hooks.
"""

from __future__ import annotations

import asyncio
import logging

from sluice.gateway.http_app import App
from sluice.gateway.http_connection import Connection

log = logging.getLogger("sluice.gateway.http")


class HttpServer:
    def __init__(self, app: App, keepalive_s: float = 75.0, grace_s: float = 10.0,
                 write_timeout_s: float = 60.0) -> None:
        assert keepalive_s > 0 and grace_s >= 0 and write_timeout_s > 0
        self.app = app
        self.keepalive_s = keepalive_s
        self.grace_s = grace_s
        self.write_timeout_s = write_timeout_s
        self.stopping = False
        self.connections: set[Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        for hook in self.app.on_startup:
            await hook()
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Connection(self), host, port, backlog=2048, reuse_address=True)

    async def stop(self) -> None:
        """Stop listening; close idle connections; give running handlers `grace_s`;
        then cut every connection left, wait for the cancelled handlers to end,
        and run the cleanup hooks."""
        loop = asyncio.get_running_loop()
        self.stopping = True  # answers from now on close their connection
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.task is None:
                conn.transport.close()
        deadline = loop.time() + self.grace_s
        while any(c.task is not None for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        tasks = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            conn.transport.abort()  # (close() would wait for a client that does not read)
        await asyncio.gather(*tasks, return_exceptions=True)
        for hook in self.app.on_cleanup:
            await hook()


def serve(app: App, host: str, port: int) -> None:
    """Serve `app` until SIGINT / SIGTERM, on uvloop when it is installed."""
    import gc
    import signal

    async def main() -> None:
        server = HttpServer(app)
        await server.start(host, port)
        # What start-up allocated (modules, tokenizers, templates: ~50k objects) is
        # moved out of the collector's reach, as vLLM's server does: a full
        # collection scanned it in ~20 ms, a pause every request then waited for.
        gc.collect()
        gc.freeze()
        log.info("listening on http://%s:%d", host, port)
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
