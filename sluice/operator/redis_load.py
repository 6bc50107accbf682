"""Fallback load source: the gateway's load table in Redis (`sluice:load:<pod>`).

Gateways scrape every engine and publish `waiting`, `running`, `kv_usage`, `ts_ms` per
pod with a short TTL (`sluice.index_keys`). The operator reads it when it cannot reach
the engines itself (e.g. a NetworkPolicy lets only the gateway talk to them). An
expired or partial entry means "unknown" and that engine is left out of the mean.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sluice.operator.autoscale import LoadSample
from sluice.operator.metrics import aggregate

Sampler = Callable[[list[dict[str, Any]], str], Awaitable[LoadSample | None]]


def redis_sampler(url: str) -> Sampler:
    """Sampler over the Redis at `url` (never logged: it may hold a password)."""
    import redis

    from sluice import index_keys

    client = redis.Redis.from_url(url, socket_timeout=2)

    def read(pods: list[str]) -> LoadSample | None:
        pipe = client.pipeline(transaction=False)
        for pod in pods:
            pipe.hgetall(index_keys.load_key(pod))
        loads = [index_keys.parse_load(fields) for fields in pipe.execute()]
        return aggregate([(load["kv_usage"], load["waiting"]) for load in loads if load])

    async def sample(endpoints: list[dict[str, Any]], role: str) -> LoadSample | None:
        pods = [e["url"].removeprefix("http://") for e in endpoints
                if e.get("ready") and e.get("role") == role]
        if not pods:
            return None
        try:
            return await asyncio.to_thread(read, pods)
        except redis.RedisError:
            return None

    return sample


def first_of(*samplers: Sampler) -> Sampler:
    """The first sampler that returns a sample wins (engines first, then Redis)."""
    async def sample(endpoints: list[dict[str, Any]], role: str) -> LoadSample | None:
        for sampler in samplers:
            result = await sampler(endpoints, role)
            if result is not None:
                return result
        return None
    return sample
