"""Read a pool's live load from its engines' Prometheus `/metrics` (vLLM names).

Both engine kinds export `vllm:kv_cache_usage_perc` and `vllm:num_requests_waiting`
(docs/contracts.md, ANCHORS). Only ready engines with an IP are scraped, in
parallel, each with a timeout; an engine that fails to answer is left out of the
mean (it is not ready to take load anyway).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

from sluice.operator.autoscale import LoadSample

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_gauges(text: str) -> dict[str, float]:
    """Sum of each metric's samples across label sets (one model per engine)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def engine_load(gauges: dict[str, float]) -> tuple[float, float] | None:
    kv = gauges.get(KV_USAGE, gauges.get(KV_USAGE_OLD))
    if kv is None:
        return None
    return kv, gauges.get(WAITING, 0.0)


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
    return engine_load(parse_gauges(response.text))


async def sample_pool(http: httpx.AsyncClient, endpoints: list[dict[str, Any]],
                      role: str, timeout: float) -> LoadSample | None:
    urls = [e["url"] for e in endpoints if e.get("ready") and e.get("role") == role]
    loads = await asyncio.gather(*(scrape(http, u, timeout) for u in urls))
    return aggregate([load for load in loads if load is not None])
