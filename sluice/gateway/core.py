"""The picker's routing core: discovery, KV-event index, loads, pod health, router.

It owns the state every request reads (the index, the load table, the pods'
health and in-flight counts) and the background work that keeps it current:
the KV-event feeder (its own thread), the speculation mirror (its own thread),
the load scraper, the health probes and the models refresh (tasks on the event
loop). Requests reach it through `server.picker.EndpointPicker`; Envoy carries
their bytes. All coroutines run on one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.gateway.discovery.health import HealthTracker
from sluice.gateway.discovery.pod_client import PodClient
from sluice.gateway.discovery.registry import PodRegistry
from sluice.gateway.discovery.static import Discovery
from sluice.gateway.events.feed import EventFeeder
from sluice.gateway.index.local_index import LocalIndex, LocalIndexConfig
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.index.redis_index import RedisIndex
from sluice.gateway.index.spec_mirror import SpecMirror
from sluice.gateway.load.inflight import InFlight
from sluice.gateway.load.scrape import LoadScraper
from sluice.gateway.load.table import LoadTable
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.prompt.tokenize import PromptTokenizer
from sluice.gateway.routing.config import load_plan, read_document
from sluice.gateway.routing.plan import RoutingPlan
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.scheduler import Decision, Scheduler
from sluice.zmq_curve import ZmqSecurity


@dataclass(frozen=True)
class CoreConfig:
    routing: str = "kv_aware"  # a shipped configuration's name, or the document's name
    # an EndpointPickerConfig (`routing.config`); None: the shipped one named `routing`
    routing_document: Mapping[str, Any] | None = field(default=None, repr=False)
    default_block_size: int = 16  # a pod's block size until it reports its own
    seed: int = 0  # random tie breaks
    local_index: LocalIndexConfig = field(default_factory=LocalIndexConfig)
    redis_url: str | None = None
    scrape_interval_s: float = 0.15
    load_ttl_ms: int = 1000
    max_failures: int = 3  # failed attempts in a row (Envoy retried elsewhere) that eject
    probe_interval_s: float = 1.0
    max_ejection_fraction: float = 0.5  # of the pods, ejected at once at most (at least 1)
    redis_timeout_s: float = 0.05
    speculative_flush_ms: float = 10.0  # decisions batched this long before Redis has them
    index_reads: str = "local"  # "redis": one Redis round trip per lookup (see PrefixIndex)
    forget_pod_after_s: float = 30.0  # a removed pod's index entries are kept this long
    models_refresh_s: float = 10.0  # every pod's /v1/models read again (LoRA adapters)
    engine_api_key: str | None = field(default=None, repr=False)  # the engines' own key
    kv_events_curve_dir: str | None = None  # CURVE keys of the engines' event sockets

    def __post_init__(self) -> None:
        assert self.scrape_interval_s > 0 and self.load_ttl_ms > 0
        assert self.forget_pod_after_s >= 0 and self.speculative_flush_ms > 0
        assert self.max_failures >= 1 and self.probe_interval_s > 0 and self.models_refresh_s > 0
        assert 0.0 <= self.max_ejection_fraction <= 1.0
        assert self.index_reads in ("redis", "local") and self.default_block_size > 0


class RoutingCore:
    def __init__(self, cfg: CoreConfig, discovery: Discovery,
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
        self.plan: RoutingPlan = load_plan(
            cfg.routing_document or read_document(shipped=cfg.routing), cfg.routing,
            PluginContext(self.index, load_ttl_ms=cfg.load_ttl_ms,
                          metrics=self.metrics.registry, seed=cfg.seed),
            cfg.default_block_size)
        uses_events = self.plan.uses_events
        self.speculation = self.plan.renewer()
        spec_ttl_ms = self.speculation.ttl_ms if self.speculation is not None else 0
        security = ZmqSecurity(cfg.kv_events_curve_dir) if cfg.kv_events_curve_dir else None
        self.feeder = EventFeeder(self.index, security=security) if uses_events else None
        # routing on the own view: the other replicas' decisions are mirrored into it
        self.mirror = (SpecMirror(self.redis.sync, self.index.local, self.redis.replica_id,
                                  max(spec_ttl_ms, 1))
                       if uses_events and self.redis is not None and self.index.read_local
                       else None)
        if self.mirror is not None:  # (its own decisions are published for the others only)
            self.redis.own_mirror = self.mirror.subscribed
        self.http = PodClient(engine_api_key=cfg.engine_api_key)
        self.registry = PodRegistry(self.feeder, self.redis, self.loads, self.health,
                                    self.http, cfg.probe_interval_s, cfg.forget_pod_after_s)
        self.flight = InFlight(self._renew, spec_ttl_ms / 2000.0 or 1.0)  # half the TTL
        self.scheduler = Scheduler(self.plan, self.loads, self)
        self.registry.on_remove.append(self.metrics.forget_pod)
        self.registry.on_remove.extend(p.forget_pod for p in self.plan.plugins.values()
                                       if hasattr(p, "forget_pod"))
        self.index.on_mode_change.append(  # back from an outage or a loss of Redis's data
            lambda mode: mode == "redis" and self.registry.register_all())
        self.scraper = LoadScraper(self.loads, self.redis, self.registry.active, self.http,
                                   cfg.scrape_interval_s)
        self._tasks: list[asyncio.Task] = []

    def _renew(self, d: Decision) -> None:
        """A running request's speculative entries last their TTL from now."""
        if d.spec_keys and self.speculation is not None:
            self.speculation.renew(d.pod, d.spec_keys)

    # -- the scheduler's PodView -------------------------------------------------------------
    def is_healthy(self, pod: str) -> bool:
        return self.health.is_healthy(pod)

    def inflight(self, pod: str) -> int:
        return self.flight.inflight.get(pod, 0)

    def pending_prefill(self, pod: str) -> int:
        return self.flight.pending_prefill.get(pod, 0)

    def block_size(self, pod: str) -> int | None:
        # the events' block size first: the index's keys were made with it
        return self.index.block_size(pod) or self.registry.block_size_of(pod)

    def key_model(self, pod: str, model: str) -> str | None:
        return self.registry.key_model(pod, model)

    def role_of(self, pod: str) -> str | None:
        return self.registry.role_of(pod)

    def index_mode(self) -> str:
        return self.index.mode

    # -- lifetime ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self.feeder is not None:
            self.feeder.start()
        if self.mirror is not None:
            self.mirror.start()
        await self.discovery.start(self.registry.update)
        self.scraper.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.health.probe_loop(
            self.http, lambda: list(self.registry.active()), self.registry.url_of)))
        self._tasks.append(loop.create_task(self.registry.refresh_loop(self.cfg.models_refresh_s)))
        self._tasks.append(loop.create_task(self._gauges_loop()))

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

    async def _gauges_loop(self, every_s: float = 1.0) -> None:
        """The gauges Prometheus reads (served by the picker's metrics port)."""
        while True:
            pods = self.registry.active()
            bad = sum(1 for p in pods if not self.health.is_healthy(p))
            self.metrics.pods.labels("healthy").set(len(pods) - bad)
            self.metrics.pods.labels("unhealthy").set(bad)
            if self.feeder is not None:
                self.metrics.event_batches.set(self.feeder.batches)
            await asyncio.sleep(every_s)
