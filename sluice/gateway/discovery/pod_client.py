"""Requests to engine pods (metrics scrapes, /health probes, /v1/models, /tokenize)
over aiohttp.

Off the request path: Envoy carries every client request. One session, its
connections kept alive per pod (a scrape every 150 ms per pod would otherwise
open a connection each time). `get` and `post_json` raise one of `POD_ERRORS` on
any transport failure or timeout, and return (status, body) for any HTTP answer.
"""

from __future__ import annotations

import asyncio

import aiohttp

POD_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError,
                                               OSError)
MAX_BODY = 8 << 20  # a /metrics page of a pod with many LoRA adapters is < 1 MiB


class PodClient:
    """Owned by the event loop it was first used on."""

    def __init__(self, per_host: int = 8, engine_api_key: str | None = None) -> None:
        """`engine_api_key`: the engines' own key (`sluice engine --api-key`, vLLM's),
        sent with every request to them; Envoy's routed requests carry it too."""
        self.per_host = per_host
        self.authorization = f"Bearer {engine_api_key}" if engine_api_key else None
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"authorization": self.authorization} if self.authorization else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=self.per_host),
                auto_decompress=False, raise_for_status=False, headers=headers)
        return self._session

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._client().get(url, timeout=timeout, allow_redirects=False) as r:
            body = await r.content.read(MAX_BODY)
            return r.status, body

    async def post_json(self, url: str, body: dict, timeout_s: float) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._client().post(url, json=body, timeout=timeout,
                                       allow_redirects=False) as r:
            return r.status, await r.content.read(MAX_BODY)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
