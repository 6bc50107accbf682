"""The gateway process: an HTTP app wiring discovery, index, load, routing, proxy.

Endpoints: POST /v1/completions, POST /v1/chat/completions (OpenAI-compatible,
streamed through), GET /v1/models (every model of every pool), GET /health,
GET /metrics. The request's `model` selects the pool. Bad input is answered
OpenAI-shaped: malformed JSON / body -> 400, unknown model -> 404, body over
`max_body_bytes` -> 413, unknown path -> 404, wrong method -> 405.

The gateway's own lean HTTP server and engine client serve it (`http_server`,
`http_pool`; not FastAPI, as the engine, nor aiohttp, as before): this process
does nothing but route and relay, and their CPU per request is most of its
overhead (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sluice.gateway.discovery import Discovery
from sluice.gateway.errors import error_response
from sluice.gateway.event_feed import EventFeeder
from sluice.gateway.health import HealthTracker
from sluice.gateway.http_app import App, Request
from sluice.gateway.http_pool import HttpPool
from sluice.gateway.http_wire import Response
from sluice.gateway.inflight import InFlight
from sluice.gateway.load import LoadScraper, LoadTable
from sluice.gateway.local_index import LocalIndex, LocalIndexConfig
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.prefix_index import PrefixIndex
from sluice.gateway.prompt import PromptTokenizer
from sluice.gateway.proxy import Proxy, ProxyConfig
from sluice.gateway.redis_index import RedisIndex
from sluice.gateway.registry import PodRegistry
from sluice.gateway.routing.config import RoutingConfig
from sluice.gateway.routing.router import Decision, Router
from sluice.gateway.server.requests import BadRequest, parse_request
from sluice.gateway.spec_mirror import SpecMirror

log = logging.getLogger("sluice.gateway")

_FORWARD_HEADERS = ("authorization", "accept", "x-request-id")


@dataclass(frozen=True)
class GatewayConfig:
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    local_index: LocalIndexConfig = field(default_factory=LocalIndexConfig)
    redis_url: str | None = None
    max_body_bytes: int = 10 * 1024 * 1024
    scrape_interval_s: float = 0.15
    load_ttl_ms: int = 1000
    max_failures: int = 3  # connection failures in a row that eject a pod
    probe_interval_s: float = 1.0
    max_ejection_fraction: float = 0.5  # of the pods, ejected at once at most (at least 1)
    redis_timeout_s: float = 0.05
    speculative_flush_ms: float = 10.0  # decisions batched this long before Redis has them
    index_reads: str = "local"  # "redis": one Redis round trip per lookup (see PrefixIndex)
    forget_pod_after_s: float = 30.0  # a removed pod's index entries are kept this long
    models_refresh_s: float = 10.0  # every pod's /v1/models read again (LoRA adapters)

    def __post_init__(self) -> None:
        assert self.max_body_bytes > 0 and self.scrape_interval_s > 0 and self.load_ttl_ms > 0
        assert self.forget_pod_after_s >= 0 and self.speculative_flush_ms > 0
        assert self.max_failures >= 1 and self.probe_interval_s > 0 and self.models_refresh_s > 0
        assert 0.0 <= self.max_ejection_fraction <= 1.0
        assert self.index_reads in ("redis", "local")


class Gateway:
    def __init__(self, cfg: GatewayConfig, discovery: Discovery,
                 tokenizer: PromptTokenizer | None = None) -> None:
        self.cfg = cfg
        self.discovery = discovery
        self.tokenizer = tokenizer or PromptTokenizer({})
        self.metrics = GatewayMetrics()
        self.health = HealthTracker(cfg.max_failures, cfg.probe_interval_s,
                                    cfg.max_ejection_fraction,
                                    pool_size=lambda: len(self.registry.active()))
        self.loads = LoadTable(cfg.load_ttl_ms)
        self.redis: RedisIndex | None = None
        if cfg.redis_url:
            self.redis = RedisIndex.from_url(cfg.redis_url, max(cfg.redis_timeout_s, 0.2))
        self.index = PrefixIndex(LocalIndex(cfg.local_index), self.redis, cfg.redis_timeout_s,
                                 cfg.speculative_flush_ms / 1000.0,
                                 read_local=cfg.index_reads == "local")
        self.index.on_mode_change.append(self.metrics.set_mode)
        self.metrics.set_mode(self.index.mode)
        uses_events = cfg.routing.strategy == "kv_aware"
        self.feeder = EventFeeder(self.index) if uses_events else None
        # routing on the own view: the other replicas' decisions are mirrored into it
        self.mirror = (SpecMirror(self.redis.sync, self.index.local, self.redis.replica_id)
                       if uses_events and self.redis is not None and self.index.read_local
                       else None)
        self.http = HttpPool()
        self.registry = PodRegistry(self.feeder, self.redis, self.loads, self.health,
                                    self.http, cfg.probe_interval_s, cfg.forget_pod_after_s)
        flight = InFlight(lambda d: self.router.renew_speculation(d),
                          cfg.routing.speculative_ttl_ms / 2000.0 or 1.0)  # half the TTL
        self.router = Router(cfg.routing, self.index, LocalIndex(cfg.local_index), self.loads,
                             self.health.is_healthy, lambda p: flight.inflight.get(p, 0),
                             # the events' block size: the index's keys were made with it
                             lambda p: self.index.block_size(p) or self.registry.block_size_of(p),
                             lambda p: flight.pending_prefill.get(p, 0),
                             self.registry.key_model)
        self.proxy = Proxy(cfg.proxy, self.http, self.health, self.metrics,
                           self.registry.url_of, flight)
        self.registry.on_remove.append(self.metrics.forget_pod)
        self.index.on_mode_change.append(  # back from an outage or a loss of Redis's data
            lambda mode: mode == "redis" and self.registry.register_all())
        self.scraper = LoadScraper(self.loads, self.redis, self.registry.active, self.http,
                                   cfg.scrape_interval_s)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        if self.feeder is not None:
            self.feeder.start()
        if self.mirror is not None:
            self.mirror.start()
        await self.discovery.start(self.registry.update)
        self.scraper.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(
            self.health.probe_loop(self.http, lambda: list(self.registry.active()),
                                   self.registry.url_of)))
        self._tasks.append(loop.create_task(self.registry.refresh_loop(self.cfg.models_refresh_s)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.registry.close()
        await self.discovery.stop()
        await self.scraper.stop()
        if self.feeder is not None:
            await asyncio.to_thread(self.feeder.stop)
        if self.mirror is not None:
            await asyncio.to_thread(self.mirror.stop)
        await self.http.close()
        if self.redis is not None:
            await self.redis.aio.aclose()
            self.redis.sync.close()

    # -- request path ----------------------------------------------------------------------
    async def handle(self, request: Request, kind: str) -> Response | None:
        try:
            data = parse_request(kind, request.body)
        except BadRequest as err:
            self.metrics.errors.labels("bad_request").inc()
            return error_response(400, err.message, err.param)
        model = data["model"]
        if not self.registry.serves(model):
            if self.registry.may_serve(model):  # known, but no engine of it is ready
                self.metrics.errors.labels("no_pod").inc()
                return error_response(503, f"no engine of model {model!r} is ready",
                                      headers={"retry-after": "1"})
            self.metrics.errors.labels("unknown_model").inc()
            return error_response(404, f"model {model!r} does not exist", "model")
        started = time.perf_counter()
        token_ids: list[int] | None = None
        if self.cfg.routing.strategy in ("prefix", "kv_aware"):
            try:
                token_ids = self.tokenizer.token_ids(kind, data)
            except Exception as err:  # noqa: BLE001 -- the engine rejects it itself
                self.metrics.errors.labels("tokenize").inc()
                log.debug("tokenization failed (%s); routing without prefix", err)
        routed: list[Decision] = []
        salt = data.get("cache_salt")

        async def route(exclude: frozenset[str]) -> Decision | None:
            d = await self.router.route(model, token_ids or [], self.registry.pods_for(model),
                                        exclude, salt if isinstance(salt, str) else None)
            if d is not None:
                if not routed:
                    self.metrics.route_seconds.observe(time.perf_counter() - started)
                routed.append(d)
                self.metrics.decided(d.strategy, d.pod, d.hit_blocks, d.total_blocks)
            return d

        headers = {"content-type": "application/json"}
        for name in _FORWARD_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        return await self.proxy.forward(request, path, request.body, headers, route)

    def models_body(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "sluice",
             "root": m, "parent": None} for m in self.registry.models()]}

    def health_body(self) -> tuple[int, dict[str, Any]]:
        pods = self.registry.active()
        healthy = [p for p in pods if self.health.is_healthy(p)]
        feed = "off" if self.feeder is None else "running" if self.feeder.alive() else "stopped"
        body = {"status": "ok" if healthy else "no_healthy_engines", "index": self.index.mode,
                "event_feed": feed, "pods": {p: self.health.is_healthy(p) for p in pods}}
        return (200 if healthy else 503), body

    def metrics_text(self) -> bytes:
        pods = self.registry.active()
        bad = sum(1 for p in pods if not self.health.is_healthy(p))
        self.metrics.pods.labels("healthy").set(len(pods) - bad)
        self.metrics.pods.labels("unhealthy").set(bad)
        if self.feeder is not None:
            self.metrics.event_batches.set(self.feeder.batches)
        return generate_latest(self.metrics.registry)


GATEWAY = "gateway"  # app.state key of the Gateway


def _json(body: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(body).encode(), {"content-type": "application/json"})


def create_app(gateway: Gateway) -> App:
    """The gateway's HTTP app (serve it with `http_server.serve` or `HttpServer`)."""
    app = App(gateway.cfg.max_body_bytes)
    app.state[GATEWAY] = gateway
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)

    def rejected(status: int) -> None:
        kind = {404: "not_found", 405: "not_found", 500: "internal"}.get(status, "bad_request")
        gateway.metrics.errors.labels(kind).inc()

    app.on_reject = rejected

    async def completions(request: Request) -> Response | None:
        return await gateway.handle(request, "completion")

    async def chat(request: Request) -> Response | None:
        return await gateway.handle(request, "chat")

    async def models(request: Request) -> Response:
        return _json(gateway.models_body())

    async def health(request: Request) -> Response:
        status, body = gateway.health_body()
        return _json(body, status)

    async def metrics(request: Request) -> Response:
        return Response(200, gateway.metrics_text(), {"content-type": CONTENT_TYPE_LATEST})

    app.add("POST", "/v1/completions", completions)
    app.add("POST", "/v1/chat/completions", chat)
    app.add("GET", "/v1/models", models)
    app.add("GET", "/health", health)
    app.add("GET", "/metrics", metrics)
    return app
