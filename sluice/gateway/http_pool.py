"""The gateway's one HTTP client pool to the engines (`http_client.Connection`s).

Not aiohttp's client (which it replaced): on the request path that cost ~0.3 ms
of CPU per request at 200 requests/s on the dev machine, as much as the rest of
the gateway. Bodies pass through as they are: nothing is compressed or
decompressed, and no `Accept-Encoding` is added.

Keep-alive: an idle connection is reused last-in first-out and dropped after
`idle_s` (below the 5 s after which uvicorn, which serves vLLM and the Sluice
engine, closes an idle connection, so a reused one is rarely stale). A
request on a reused connection that the engine closed before any byte of an
answer is sent once more on a new connection: the engine closed it idle and
never read the request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

from sluice.gateway.http_client import (ConnectError, ConnectTimeout, Connection,
                                        Disconnected, ReadTimeout, UpstreamError)
from sluice.gateway.http_wire import request_head

# Everything a failed exchange raises.
HTTP_ERRORS: tuple[type[BaseException], ...] = (UpstreamError,)


class HttpPool:
    def __init__(self, max_idle_per_host: int = 512, idle_s: float = 2.0) -> None:
        assert max_idle_per_host > 0 and idle_s > 0
        self.max_idle_per_host = max_idle_per_host
        self.idle_s = idle_s
        self._idle: dict[tuple, list[Connection]] = {}
        self._targets: dict[str, tuple] = {}
        self._ssl: ssl.SSLContext | None = None
        self._swept = time.monotonic()

    def _target(self, base_url: str) -> tuple:
        """(host, port, tls, host header) of a base URL like http://10.0.0.5:8000."""
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConnectError(f"not an http(s) URL: {base_url!r}")
            tls = u.scheme == "https"
            port = u.port or (443 if tls else 80)
            host = u.netloc.rpartition("@")[2]  # the Host header: no user info
            t = self._targets[base_url] = (u.hostname, port, tls, host)
        return t

    async def request(self, base_url: str, method: str, path: str, headers: dict[str, str],
                      body: bytes, connect_timeout_s: float, read_timeout_s: float
                      ) -> Connection:
        """Send a request; returns its connection once the answer's head arrived.
        The caller reads the body, then `release()`s the connection (or closes it)."""
        host, port, tls, netloc = key = self._target(base_url)
        data = request_head(method, path, netloc, headers, len(body)) + body
        for attempt in (0, 1):
            conn = (self._pop_idle(key) if attempt == 0 else None) or await self._connect(
                key, connect_timeout_s)
            conn.send(data)
            try:
                await conn.head(read_timeout_s)
                return conn
            except Disconnected:
                conn.close()
                if attempt == 0 and conn.reused and not conn.got_bytes:
                    continue  # closed while idle, before our request reached it
                raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def release(self, conn: Connection) -> None:
        """Give back a connection whose answer was read to its end."""
        now = time.monotonic()
        idle = self._idle.setdefault(conn.key, [])
        if conn.reusable() and len(idle) < self.max_idle_per_host:
            conn.reused = True
            conn.idle_since = now
            idle.append(conn)
        else:
            conn.close()
        if now - self._swept > self.idle_s:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Drop expired idle connections of every host (of hosts no longer asked too)."""
        self._swept = now
        for key, idle in list(self._idle.items()):
            fresh = []
            for conn in idle:
                if not conn.closed and conn.idle_since >= now - self.idle_s:
                    fresh.append(conn)
                else:
                    conn.close()
            if fresh:
                self._idle[key] = fresh
            else:
                del self._idle[key]

    def _pop_idle(self, key: tuple) -> Connection | None:
        """The newest usable idle connection to `key`, dropping closed and expired
        ones on the way."""
        idle = self._idle.get(key)
        oldest = time.monotonic() - self.idle_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since >= oldest:
                return conn
            conn.close()
            if conn.idle_since < oldest:  # the rest are older still
                for stale in idle:
                    stale.close()
                idle.clear()
        return None

    async def _connect(self, key: tuple, timeout_s: float) -> Connection:
        host, port, tls, _ = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(key), host, port,
                    ssl=self._ssl if tls else None, server_hostname=host if tls else None)
        except TimeoutError:
            raise ConnectTimeout(f"{host}:{port}: no connection within {timeout_s} s") from None
        except OSError as err:
            raise ConnectError(f"{host}:{port}: {err}") from None
        return conn

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of a GET of a full URL, all within `timeout_s`; raises
        one of HTTP_ERRORS on failure."""
        u = urlsplit(url)
        base = f"{u.scheme}://{u.netloc}"
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self.request(base, "GET", path, {}, b"", timeout_s, timeout_s)
                try:
                    body = await conn.read(timeout_s)
                except BaseException:
                    conn.close()
                    raise
        except TimeoutError:
            raise ReadTimeout(f"GET {url}: no answer within {timeout_s} s") from None
        self.release(conn)
        return conn.status, body

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
