"""The gateway's one HTTP client pool to the engines (aiohttp).

aiohttp rather than httpx on this path: httpx's pool scans every pooled
connection on each request (`has_expired` on each), which at a few hundred
requests/s with hundreds of keep-alive connections cost more than a
millisecond per request in the gateway's profile.

The session must be created on the running loop: `start()` from the
gateway's startup, `close()` at shutdown. Bodies are passed through raw
(`auto_decompress=False`) and no `Accept-Encoding` is added, so an engine never
compresses unless the client asked for it.
"""

from __future__ import annotations

import asyncio

import aiohttp

# Everything a failed exchange can raise: connect, protocol, payload, timeouts.
HTTP_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)


class HttpPool:
    def __init__(self, max_connections: int = 4096, keepalive_s: float = 30.0) -> None:
        assert max_connections > 0 and keepalive_s > 0
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                         keepalive_timeout=self.keepalive_s)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              skip_auto_headers=("Accept-Encoding",),
                                              timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "HttpPool.start() was not awaited"
        return self._session

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of a GET; raises one of HTTP_ERRORS on failure."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.get(url, timeout=timeout) as resp:
            return resp.status, await resp.read()
