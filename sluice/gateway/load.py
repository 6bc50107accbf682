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
import re
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from sluice.gateway.pod_client import POD_ERRORS, PodClient

log = logging.getLogger("sluice.gateway.load")

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_hits: float = 0.0      # tokens (counter)
    prefix_queries: float = 0.0   # tokens (counter)


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Read the vLLM metrics routing needs from a Prometheus text exposition.
    Counts are summed over series (`model_name`, `engine` label values); the
    KV-usage fraction is their mean (vLLM exports one series per engine of a
    data-parallel server, each a fraction of its own cache)."""
    vals: dict[str, float] = {}
    series: dict[str, int] = {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name == "vllm:cache_config_info":
            info = dict(_LABEL.findall(labels))
            continue
        vals[name] = vals.get(name, 0.0) + v
        series[name] = series.get(name, 0) + 1
    kv = 0.0
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        if name in vals:
            kv = vals[name] / series[name]
            break

    def as_int(s: str | None) -> int | None:
        return int(s) if s and s.isdigit() else None

    return EngineMetrics(
        waiting=vals.get("vllm:num_requests_waiting", 0.0),
        running=vals.get("vllm:num_requests_running", 0.0), kv_usage=kv,
        block_size=as_int(info.get("block_size")),
        num_gpu_blocks=as_int(info.get("num_gpu_blocks")),
        prefix_hits=vals.get("vllm:prefix_cache_hits_total", 0.0),
        prefix_queries=vals.get("vllm:prefix_cache_queries_total", 0.0))


class LoadTable:
    """Latest load per pod with its timestamp: this replica's own scrapes, and the
    entries Redis held at its last scrape (`put_shared`: another replica's may be
    newer), so replicas that route on their own view read the shared figures too."""

    def __init__(self, ttl_ms: int) -> None:
        assert ttl_ms > 0
        self.ttl_ms = ttl_ms
        self._rows: dict[str, tuple[float, EngineMetrics]] = {}
        self._shared: dict[str, dict[str, float]] = {}

    def put(self, pod: str, m: EngineMetrics, ts_ms: float) -> None:
        self._rows[pod] = (ts_ms, m)

    def put_shared(self, pod: str, row: dict[str, float] | None) -> None:
        """Redis's load entry of `pod` (fields `LOAD_FIELDS`; None: it has none)."""
        if row is None:
            self._shared.pop(pod, None)
        else:
            self._shared[pod] = row

    def drop(self, pod: str) -> None:
        self._rows.pop(pod, None)
        self._shared.pop(pod, None)

    def metrics(self, pod: str) -> EngineMetrics | None:
        row = self._rows.get(pod)
        return None if row is None else row[1]

    def fresh(self, now_ms: float) -> dict[str, dict[str, float]]:
        """Unexpired loads, shaped like the Redis load entries: per pod the newer of
        its own scrape and Redis's entry."""
        out = {pod: {"waiting": m.waiting, "running": m.running, "kv_usage": m.kv_usage,
                     "ts_ms": ts} for pod, (ts, m) in self._rows.items()}
        for pod, row in self._shared.items():
            if pod not in out or row["ts_ms"] > out[pod]["ts_ms"]:
                out[pod] = row
        return {pod: row for pod, row in out.items() if now_ms - row["ts_ms"] < self.ttl_ms}


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
