"""Pod load: scraped from each engine's `/metrics` (vLLM names), shared via Redis.

`LoadScraper` polls every pod's `/metrics` every `interval_s` (~150 ms),
keeps the figures in its local `LoadTable` and writes them to Redis
(`sluice:load:{pod}`, TTL `ttl_ms`) so every gateway replica and the
operator's autoscaler read the same numbers; in the same round trip it reads
Redis's entries back into the table (another replica may have scraped later).
An entry older than its TTL is unknown: routing does not prefer such a pod.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.exceptions import RedisError

from sluice.gateway.discovery.pod_client import POD_ERRORS, PodClient
from sluice.gateway.load.table import LoadTable
from sluice.metrics_text import EngineMetrics, parse_engine_metrics

log = logging.getLogger("sluice.gateway.load")


class LoadScraper:
    def __init__(self, table: LoadTable, redis_index: Any | None, pods: Any, http: PodClient,
                 interval_s: float = 0.15, timeout_s: float = 0.5) -> None:
        """`pods()` returns {pod id: base URL} to scrape right now."""
        self.table = table
        self.redis = redis_index
        self.pods = pods
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.http = http
        self._task: asyncio.Task | None = None

    async def _one(self, pod: str, url: str) -> tuple[str, EngineMetrics] | None:
        try:
            status, body = await self.http.get(url.rstrip("/") + "/metrics", self.timeout_s)
        except POD_ERRORS:
            return None
        if status != 200:
            return None
        return pod, parse_engine_metrics(body.decode(errors="replace"))

    async def scrape_once(self) -> int:
        targets = dict(self.pods())
        results = await asyncio.gather(*(self._one(p, u) for p, u in targets.items()))
        now = time.time() * 1000.0
        fresh = {}
        for r in results:
            if r is not None:
                self.table.put(r[0], r[1], now)
                fresh[r[0]] = {"waiting": r[1].waiting, "running": r[1].running,
                               "kv_usage": r[1].kv_usage, "ts_ms": now}
        if targets and self.redis is not None:
            try:
                shared = await asyncio.wait_for(
                    self.redis.write_loads(fresh, self.table.ttl_ms, list(targets)), 0.5)
            except (TimeoutError, RedisError, OSError):
                shared = {}  # the index notices Redis outages; loads stay local meanwhile
            active = self.pods()  # (a pod dropped meanwhile must not come back)
            for pod in targets:
                if pod in shared and pod in active:
                    self.table.put_shared(pod, shared[pod])
                else:  # expired in Redis: not known through it any more
                    self.table.put_shared(pod, None)
        return len(fresh)

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.scrape_once()
            except Exception:  # never let the loop die
                log.exception("load scrape failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
