"""A lean asyncio Redis client for the request path: RESP2, one pipelined connection.

Why not redis-py's asyncio client: on the 2-vCPU CI machine it spends ~120 us
of Python per call (a PING took 135 us against a loopback Redis), and a
kv_aware decision makes two calls (lookup, speculative write). Here a call is
one `transport.write` of bytes built directly and a future completed by
hiredis' C reply parser.

Contract:
- `call(*args)` sends one command and returns its reply; `pipeline(cmds)`
  sends several in one write. Commands from all callers share one connection
  in order, and replies complete their futures first in, first out.
- A caller that stops waiting (timeout, cancellation) does not desynchronise
  the connection: its reply is still read, then dropped.
- An error reply raises `redis.exceptions.ResponseError`; a lost or refused
  connection fails every pending call with `redis.exceptions.ConnectionError`,
  and the next call connects again. No call is retried: callers have their
  own fallback.
- A connection idle for `health_check_interval_s` is pinged before its next
  use and replaced if the ping fails, so one dropped while idle (by a NAT or a
  Redis restart) does not fail a request.
- URLs: `redis://[[user]:password@]host[:port][/db]`, `rediss://` (TLS) and
  `unix:///path[?db=N]`. The password never appears in errors or logs.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

Arg = bytes | str | int | float


def encode_command(args: tuple[Arg, ...]) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            a = repr(a).encode()
        elif not isinstance(a, bytes):
            raise TypeError(f"Redis arguments are bytes, str, int or float, not {type(a)}")
        out.append(b"$%d\r\n%b\r\n" % (len(a), a))
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: deque[asyncio.Future] = deque()
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as err:
                assert self.transport is not None
                self.transport.close()
                self.connection_lost(err)
                return
            if reply is False:
                return
            fut = self.waiting.popleft()
            if fut.done():  # its caller stopped waiting
                continue
            if isinstance(reply, ResponseError):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}")
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(self.lost)

    def send(self, payload: bytes, n: int) -> list[asyncio.Future]:
        if self.lost is not None:
            raise self.lost
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(n)]
        self.waiting.extend(futs)
        self.transport.write(payload)
        return futs


class RespClient:
    def __init__(self, url: str, connect_timeout_s: float = 1.0,
                 health_check_interval_s: float = 10.0) -> None:
        u = urlparse(url)
        if u.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {u.scheme!r}")
        self._unix = u.path if u.scheme == "unix" else None
        self._host, self._port = u.hostname or "127.0.0.1", u.port or 6379
        self._ssl = ssl.create_default_context() if u.scheme == "rediss" else None
        db = parse_qs(u.query).get("db", [""])[0] or (u.path.strip("/") if not self._unix else "")
        self._db = int(db or 0)
        self._auth = ([unquote(u.username)] if u.username else []) + (
            [unquote(u.password)] if u.password is not None else [])
        self.connect_timeout_s = connect_timeout_s
        self.health_check_interval_s = health_check_interval_s
        self._proto: _Protocol | None = None
        self._lock = asyncio.Lock()
        self._last_used = 0.0

    def _where(self) -> str:
        return self._unix or f"{self._host}:{self._port}"

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self._unix:
                    _, proto = await loop.create_unix_connection(_Protocol, self._unix)
                else:
                    _, proto = await loop.create_connection(
                        _Protocol, self._host, self._port, ssl=self._ssl)
        except (OSError, TimeoutError) as err:
            raise RedisConnectionError(
                f"cannot connect to Redis at {self._where()}: {type(err).__name__}") from None
        setup = ([("AUTH", *self._auth)] if self._auth else []) + (
            [("SELECT", self._db)] if self._db else [])
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await _replies(proto.send(b"".join(map(encode_command, setup)), len(setup)))
        except BaseException as err:
            assert proto.transport is not None
            proto.transport.close()
            if isinstance(err, TimeoutError):
                raise RedisConnectionError(f"Redis at {self._where()} did not answer") from None
            raise
        return proto

    async def _ready(self) -> _Protocol:
        proto = self._proto
        idle = time.monotonic() - self._last_used
        if proto is not None and proto.lost is None and idle < self.health_check_interval_s:
            return proto
        async with self._lock:
            if self._proto is not None and self._proto.lost is None:
                if time.monotonic() - self._last_used < self.health_check_interval_s:
                    return self._proto
                try:  # idle for long: make sure the connection still works
                    async with asyncio.timeout(self.connect_timeout_s):
                        await self._proto.send(encode_command(("PING",)), 1)[0]
                    self._last_used = time.monotonic()
                    return self._proto
                except (RedisConnectionError, TimeoutError):
                    self._drop()
            self._proto = await self._connect()
            self._last_used = time.monotonic()
            return self._proto

    def _drop(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None

    async def call(self, *args: Arg) -> Any:
        proto = await self._ready()
        self._last_used = time.monotonic()
        return await proto.send(encode_command(args), 1)[0]

    async def pipeline(self, commands: list[tuple[Arg, ...]]) -> list[Any]:
        """Replies of all `commands`, sent in one write; the first error is raised."""
        if not commands:
            return []
        proto = await self._ready()
        self._last_used = time.monotonic()
        return await _replies(proto.send(b"".join(map(encode_command, commands)),
                                         len(commands)))

    async def aclose(self) -> None:
        self._drop()


async def _replies(futs: list[asyncio.Future]) -> list[Any]:
    """Results of all `futs` (each retrieved, so none warns); the first error is raised."""
    done = await asyncio.gather(*futs, return_exceptions=True)
    for r in done:
        if isinstance(r, BaseException):
            raise r
    return done


class Script:
    """A Lua script run by EVALSHA, loaded with EVAL when Redis does not have it."""

    def __init__(self, client: RespClient, source: str) -> None:
        self.client = client
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Arg] = (), args: Sequence[Arg] = ()) -> Any:
        try:
            return await self.client.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except ResponseError as err:
            if not str(err).startswith("NOSCRIPT"):
                raise
        return await self.client.call("EVAL", self.source, len(keys), *keys, *args)
