"""Read a pool's live load from its engines' Prometheus `/metrics` (vLLM names).

Both engine kinds export `vllm:kv_cache_usage_perc` and `vllm:num_requests_waiting`
(docs/contracts.md, ANCHORS). Only ready engines with an IP are scraped, in
parallel, each with a timeout; an engine that fails to answer is left out of the
mean (it is not ready to take load anyway).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from sluice.metrics_text import parse_engine_metrics
from sluice.operator.autoscale import LoadSample


def engine_load(text: str) -> tuple[float, float] | None:
    """(KV usage, waiting requests) of one engine's `/metrics` page; None without a
    KV-usage gauge (not an engine, or not ready)."""
    m = parse_engine_metrics(text)
    return (m.kv_usage, m.waiting) if m.reports_kv else None


def aggregate(loads: list[tuple[float, float]]) -> LoadSample | None:
    if not loads:
        return None
    n = len(loads)
    return LoadSample(sum(k for k, _ in loads) / n, sum(q for _, q in loads) / n, n)


async def scrape(http: httpx.AsyncClient, url: str, timeout: float) -> tuple[float, float] | None:
    try:
        response = await http.get(f"{url}/metrics", timeout=timeout)
        response.raise_for_status()
    except (httpx.HTTPError, OSError):
        return None
    return engine_load(response.text)


async def sample_pool(http: httpx.AsyncClient, endpoints: list[dict[str, Any]],
                      role: str, timeout: float) -> LoadSample | None:
    urls = [e["url"] for e in endpoints if e.get("ready") and e.get("role") == role]
    loads = await asyncio.gather(*(scrape(http, u, timeout) for u in urls))
    return aggregate([load for load in loads if load is not None])
