"""Forward one request to an engine and relay its answer to the client.

An answer with a known length that is not an event stream (a non-streaming
completion) is read whole and sent in one write; anything else (SSE) is relayed
chunk by chunk as it arrives, never buffered.

Failure handling:
- connect error, 5xx or 429 before the first byte: the pod is skipped and the
  request re-routed to the next best pod, at most `max_retries` times (connect
  errors and 5xx count toward the pod's unhealthy mark; 429 does not);
- read timeout before the first byte: 504, not retried (the engine may still
  be working on it);
- no pod left: 503 (429 when every pod tried answered 429), with Retry-After;
- the pod dies while its answer is read: a buffered answer becomes a 502; a
  relayed SSE stream gets an OpenAI-shaped error event and ends. Only whole
  events are relayed (a partial one waits for its end), so the error event
  never lands inside one;
- a pod counts as healthy again only when an answer has been relayed whole:
  one that sends its head and then fails every time is marked unhealthy;
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
from sluice.gateway.http_client import Connection, ConnectTimeout, ReadTimeout, UpstreamError
from sluice.gateway.http_pool import HttpPool
from sluice.gateway.http_app import Request
from sluice.gateway.http_wire import Response
from sluice.gateway.inflight import Attempt, InFlight
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.routing.router import Decision

log = logging.getLogger("sluice.gateway.proxy")

RouteFn = Callable[[frozenset[str]], Awaitable[Decision | None]]
ERROR_TEXT_WAIT_S = 1.0  # for the body of a 5xx / 429 (its text goes into ours)
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
        busy = 0  # attempts answered 429
        for n in range(self.cfg.max_retries + 1):
            decision = await route(frozenset(tried))
            if decision is None:
                break
            pod = decision.pod
            url = self.url_of(pod)
            if url is None:
                tried.add(pod)
                continue
            if n:
                self.metrics.retries.inc()
            tried.add(pod)
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
                continue
            except ReadTimeout:
                # silent past read_timeout: not retried (it may still be working on
                # the request), but counted, so a hung pod ends up marked unhealthy
                attempt.done()
                self._failed(pod, "upstream_timeout", started)
                return error_response(504, f"engine {pod} did not answer in time", "timeout",
                                      headers=decision_headers(decision))
            except UpstreamError as err:
                attempt.done()
                self._failed(pod, "connect", started)
                last_error = f"engine {pod} unreachable: {err}"
                continue
            except BaseException:  # the client left before the answer began (cancelled)
                attempt.done()     # or a bug: either way the pod is released
                raise
            if resp.status >= 500 or resp.status == 429:
                try:
                    text = (await resp.chunk(min(self.cfg.read_timeout_s,
                                                 ERROR_TEXT_WAIT_S)))[:500].decode(
                        errors="replace")
                except UpstreamError:
                    text = ""
                finally:
                    resp.close()
                    attempt.done()
                if resp.status == 429:
                    busy += 1
                    self.metrics.errors.labels("upstream_429").inc()
                    self._observe(pod, started)
                else:
                    self._failed(pod, "upstream_5xx", started)
                last_error = f"engine {pod} answered {resp.status}: {text}"
                continue
            self.metrics.child(self.metrics.ttfb, pod).observe(time.perf_counter() - started)
            return await self._relay(request, resp, decision, started, attempt)
        self.metrics.errors.labels("no_pod").inc()
        if busy and busy == len(tried):  # every engine tried is overloaded: say so
            return error_response(429, last_error, "rate_limit_exceeded",
                                  headers={"retry-after": "1"})
        return error_response(503, last_error, "service_unavailable",
                              headers={"retry-after": "1"})

    def _failed(self, pod: str, kind: str, started: float) -> None:
        self.metrics.errors.labels(kind).inc()
        self.health.failure(pod)
        self._observe(pod, started)

    def _observe(self, pod: str, started: float) -> None:
        """The attempt's upstream time (every attempt: failed ones are the slow tail)."""
        self.metrics.child(self.metrics.upstream, pod).observe(time.perf_counter() - started)

    async def _relay(self, request: Request, resp: Connection, d: Decision,
                     started: float, attempt: Attempt) -> Response | None:
        headers = decision_headers(d)
        for name in ("content-type", "content-encoding", "x-request-id"):
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
                                               f"{err}", "upstream_error", headers=headers)
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
                                                       f"{err}", "upstream_error"))
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
        self.health.failure(pod)
        log.warning("engine %s failed mid-stream: %s", pod, type(err).__name__)
