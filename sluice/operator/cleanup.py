"""Finalizer work: remove a deleted pool's pods from the gateway's Redis prefix index.

`IndexPurger(namespace, pool, pods) -> int` is injectable (tests pass a fake). The
default uses `sluice.index_keys` (the gateway's key layout): every pod of the pool
(pod ids are `ip:8000`, from the pool's last status, its live pods and the pool's
pod set in Redis) is purged with `purge_pods`, then the pool set is deleted. Without
a Redis URL there is no purger, and so no finalizer on the pools (handlers.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("sluice.operator")

FINALIZER = "sluice.dev/index-cleanup"

IndexPurger = Callable[[str, str, list[str]], Awaitable[int]]


def redis_purger(url: str) -> IndexPurger:
    """Purger for the Redis at `url` (the URL may hold a password: never logged)."""

    def work(namespace: str, pool: str, pods: list[str]) -> int:
        import redis

        from sluice import index_keys

        client = redis.Redis.from_url(url, socket_timeout=5)
        try:
            key = index_keys.pool_pods_key(namespace, pool)
            members = {m.decode() if isinstance(m, bytes) else m for m in client.smembers(key)}
            purged = index_keys.purge_pods(client, sorted(members | set(pods)))
            client.delete(key)
            return purged
        finally:
            client.close()

    async def purge(namespace: str, pool: str, pods: list[str]) -> int:
        return await asyncio.to_thread(work, namespace, pool, pods)

    return purge


def pool_pod_ids(status_endpoints: list[dict], live_pods: list[dict]) -> list[str]:
    """Pure: `ip:port` ids of every engine the pool had, per the contract's pod id."""
    ids = {e["url"].removeprefix("http://") for e in status_endpoints if e.get("url")}
    for pod in live_pods:
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            ids.add(f"{ip}:8000")
    return sorted(ids)
