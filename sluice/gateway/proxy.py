"""Forward one request to an engine and relay its answer to the client.

An answer with a known length that is not an event stream (a non-streaming
completion) is read whole and sent in one write; anything else (SSE) is relayed
chunk by chunk as it arrives, never buffered.

Failure handling (pod health itself is `health.HealthTracker`'s):
- connect error before any answer: a connection failure of the pod; the
  request is re-routed to the next best pod, at most `max_retries` times;
- 429: the pod is busy; re-routed the same way;
- 5xx: re-routed once; a second 5xx is relayed as it is. An error that the
  same request gets from two pods is the request's, so it is neither retried
  across the pool nor held against a pod. A 429 or 5xx with no pod left to
  try is relayed as it is;
- read timeout before the first byte: 504, not retried (the engine may still
  be working on it), a connection failure of the pod;
- no pod reachable: 503 with Retry-After;
- the pod dies while its answer is read: a buffered answer becomes a 502; a
  relayed SSE stream gets an OpenAI-shaped error event and ends. Only whole
  events are relayed (a partial one waits for its end), so the error event
  never lands inside one;
- client disconnect: the server cancels the handler (or the next write fails
  with ConnectionResetError), and the upstream connection is closed, not pooled,
  so the engine sees the disconnect and aborts the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sluice.gateway.errors import error_response, sse_error
from sluice.gateway.health import HealthTracker
from sluice.gateway.http_app import Request
from sluice.gateway.http_client import Connection, ConnectTimeout, ReadTimeout, UpstreamError
from sluice.gateway.http_pool import HttpPool
from sluice.gateway.http_wire import Response
from sluice.gateway.inflight import Attempt, InFlight
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.routing.router import Decision

log = logging.getLogger("sluice.gateway.proxy")

RouteFn = Callable[[frozenset[str]], Awaitable[Decision | None]]
MAX_PARTIAL_EVENT = 1 << 20  # bytes of an unfinished SSE event held back, at most


def decision_headers(d: Decision) -> dict[str, str]:
    return {"x-sluice-pod": d.pod, "x-sluice-prefix-hit-blocks": str(d.hit_blocks),
            "x-sluice-prompt-blocks": str(d.total_blocks),
            "x-sluice-strategy": d.strategy, "x-sluice-index": d.index_mode}


def complete_events(data: bytes) -> int:
    """Length of the leading whole SSE events in `data` (each ends in a blank line)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


@dataclass(frozen=True)
class ProxyConfig:
    max_retries: int = 2
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0   # before the first byte and between chunks

    def __post_init__(self) -> None:
        assert self.max_retries >= 0 and self.connect_timeout_s > 0 and self.read_timeout_s > 0


class Proxy:
    def __init__(self, cfg: ProxyConfig, http: HttpPool, health: HealthTracker,
                 metrics: GatewayMetrics, url_of: Callable[[str], str | None],
                 flight: InFlight | None = None) -> None:
        self.cfg = cfg
        self.http = http
        self.health = health
        self.metrics = metrics
        self.url_of = url_of
        self.flight = flight or InFlight()

    async def forward(self, request: Request, path: str, body: bytes,
                      headers: dict[str, str], route: RouteFn) -> Response | None:
        """The answer to send (None: it was streamed to the client already)."""
        tried: set[str] = set()
        last_error = "no healthy engine for this model"
        server_errors = 0  # attempts answered 5xx

        async def again(n: int) -> Decision | None:
            """The pod for attempt n + 1; None when the retry budget or the pool is spent."""
            return await route(frozenset(tried)) if n < self.cfg.max_retries else None

        decision = await route(frozenset())
        for n in range(self.cfg.max_retries + 1):
            if decision is None:
                break
            pod = decision.pod
            tried.add(pod)
            url = self.url_of(pod)
            if url is None:
                decision = await again(n)
                continue
            if n:
                self.metrics.retries.inc()
            attempt = self.flight.start(decision)
            started = time.perf_counter()
            try:
                resp = await self.http.request(url, "POST", path, headers, body,
                                               self.cfg.connect_timeout_s,
                                               self.cfg.read_timeout_s)
            except ConnectTimeout:
                attempt.done()
                self._failed(pod, "connect_timeout", started)
                last_error = f"engine {pod} did not accept the connection"
                decision = await again(n)
                continue
            except ReadTimeout:
                # silent past read_timeout: not retried (it may still be working on
                # the request), but counted, so a hung pod ends up ejected
                attempt.done()
                self._failed(pod, "upstream_timeout", started)
                return error_response(504, f"engine {pod} did not answer in time",
                                      headers=decision_headers(decision))
            except UpstreamError as err:
                attempt.done()
                self._failed(pod, "connect", started)
                last_error = f"engine {pod} unreachable: {err}"
                decision = await again(n)
                continue
            except BaseException:  # the client left before the answer began (cancelled)
                attempt.done()     # or a bug: either way the pod is released
                raise
            if resp.status == 429:
                self.metrics.errors.labels("upstream_429").inc()
            elif resp.status >= 500:
                self.metrics.errors.labels("upstream_5xx").inc()
                server_errors += 1
            retry = resp.status == 429 or resp.status >= 500 and server_errors == 1
            nxt = await again(n) if retry else None
            if nxt is None:  # relayed as it is: a success, or the last word on an error
                self.metrics.child(self.metrics.ttfb, pod).observe(time.perf_counter() - started)
                return await self._relay(request, resp, decision, started, attempt)
            resp.close()
            attempt.done()
            self._observe(pod, started)
            decision = nxt
        self.metrics.errors.labels("no_pod").inc()
        return error_response(503, last_error, headers={"retry-after": "1"})

    def _failed(self, pod: str, kind: str, started: float) -> None:
        self.metrics.errors.labels(kind).inc()
        self.health.connection_failure(pod)
        self._observe(pod, started)

    def _observe(self, pod: str, started: float) -> None:
        """The attempt's upstream time (every attempt: failed ones are the slow tail)."""
        self.metrics.child(self.metrics.upstream, pod).observe(time.perf_counter() - started)

    async def _relay(self, request: Request, resp: Connection, d: Decision,
                     started: float, attempt: Attempt) -> Response | None:
        headers = decision_headers(d)
        for name in ("content-type", "content-encoding", "x-request-id", "retry-after"):
            if name in resp.headers:
                headers[name] = resp.headers[name]
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        timeout = self.cfg.read_timeout_s
        eof = False
        try:
            if not sse and "content-length" in resp.headers:
                try:
                    data = await resp.read(timeout)
                except UpstreamError as err:
                    self._failed_mid_stream(d.pod, err)
                    return error_response(502, f"engine {d.pod} failed while answering: "
                                               f"{err}", headers=headers)
                eof = True
                attempt.prefilled()
                return Response(resp.status, data, headers)
            out = request.stream(resp.status, headers)
            partial = b""  # (SSE) the start of an event whose end has not arrived
            while True:
                try:
                    chunk = await resp.chunk(timeout)
                except UpstreamError as err:
                    self._failed_mid_stream(d.pod, err)
                    if sse:  # the client learns why, then the stream ends properly
                        await out.write(sse_error(502, f"engine {d.pod} failed mid-stream: "
                                                       f"{err}"))
                        out.end()
                    return None  # (other bodies are cut: the client sees them truncated)
                if not chunk:
                    eof = True
                    if partial:  # (an engine that ends without a blank line)
                        await out.write(partial)
                    out.end()
                    return None
                attempt.prefilled()  # (first body bytes: the prefill is over)
                if sse:
                    chunk = partial + chunk if partial else chunk
                    end = complete_events(chunk)
                    if len(chunk) - end > MAX_PARTIAL_EVENT:  # not SSE after all: bounded
                        end = len(chunk)
                    chunk, partial = chunk[:end], chunk[end:]
                    if not chunk:
                        continue
                await out.write(chunk)
        finally:
            if eof:
                self.http.release(resp)  # the connection goes back to the pool
                self.health.success(d.pod)
            else:
                resp.close()  # the engine sees the disconnect and aborts
            attempt.done()
            self._observe(d.pod, started)

    def _failed_mid_stream(self, pod: str, err: BaseException) -> None:
        self.metrics.errors.labels("mid_stream").inc()
        self.health.connection_failure(pod)
        log.warning("engine %s failed mid-stream: %s", pod, type(err).__name__)
