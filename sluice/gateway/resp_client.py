"""A lean asyncio Redis client for the request path: RESP2, one pipelined connection.

Why not redis-py's asyncio client: on the 2-vCPU CI machine it spends ~120 us
of Python per call (a PING took 135 us against a loopback Redis), and a
kv_aware decision makes two calls (lookup, speculative write). Here a call is
one `transport.write` of bytes built directly and a future completed by
hiredis' C reply parser.

Contract:
- `call(*args)` sends one command and returns its reply; `pipeline(cmds)`
  sends several in one write (`redis_script.run_scripts`: several Lua script calls). Commands
  from all callers share one connection in order, and replies complete their
  futures first in, first out.
- A caller that stops waiting (timeout, cancellation) does not desynchronise
  the connection: its reply is still read, then dropped. `deadline` (a
  `time.monotonic()` value) bounds a call, its connect included: past it the
  call raises `TimeoutError`. It is one timer per call, not `asyncio.timeout`
  (~3x its cost on the request path).
- An error reply raises `redis.exceptions.ResponseError`; a lost or refused
  connection fails every pending call with `redis.exceptions.ConnectionError`,
  and the next call connects again. No call is retried: callers have their
  own fallback.
- A connection whose oldest unanswered call is older than `timeout_s` is
  replaced before the next call (the calls waiting on it fail): a Redis that
  went silent without closing the connection is not waited on for good.
- A connection idle for `health_check_interval_s` is pinged before its next
  use and replaced if the ping fails, so one dropped while idle (by a NAT or a
  Redis restart) does not fail a request. Connects and these pings are shared
  by the callers that wait for them and are not cancelled with one of them.
- URLs are parsed by redis-py (`redis://[[user]:password@]host[:port][/db]`,
  `?password=`, `rediss://` with its `ssl_*` options, `unix:///path[?db=N]`),
  so both clients of a gateway read one URL alike; other URL options are an
  error. The password never appears in errors or logs.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import Any
from urllib.parse import urlparse

import hiredis
from redis.connection import parse_url
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
        self.waiting: deque[tuple[asyncio.Future, float]] = deque()  # (future, sent at)
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as err:
                self.fail(RedisConnectionError(f"Redis protocol error: {err}"))
                return
            if reply is False:
                return
            fut, _ = self.waiting.popleft()
            if fut.done():  # its caller stopped waiting
                continue
            if isinstance(reply, ResponseError):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def fail(self, err: Exception) -> None:
        """Close the connection; every call still waiting on it fails with `err`."""
        if self.lost is None:
            self.lost = err
        if self.transport is not None:
            self.transport.close()
        while self.waiting:
            fut, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(RedisConnectionError(str(self.lost)))

    def stalled(self, now: float, timeout_s: float) -> bool:
        """The oldest unanswered call was sent more than `timeout_s` ago."""
        return bool(self.waiting) and now - self.waiting[0][1] > timeout_s

    def send(self, payload: bytes, n: int) -> list[asyncio.Future]:
        if self.lost is not None:
            raise RedisConnectionError(str(self.lost))
        assert self.transport is not None
        now = time.monotonic()
        futs = [self.loop.create_future() for _ in range(n)]
        self.waiting.extend((f, now) for f in futs)
        self.transport.write(payload)
        return futs


_SSL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
                "ssl_check_hostname")


def _ssl_context(opts: dict[str, Any]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=opts.get("ssl_ca_certs"))
    if opts.get("ssl_certfile"):
        ctx.load_cert_chain(opts["ssl_certfile"], opts.get("ssl_keyfile"))
    reqs = opts.get("ssl_cert_reqs", "required")
    if opts.get("ssl_check_hostname") is False or reqs in ("none", "optional", ssl.CERT_NONE):
        ctx.check_hostname = False
    if reqs in ("none", ssl.CERT_NONE):
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class RespClient:
    def __init__(self, url: str, timeout_s: float = 1.0,
                 health_check_interval_s: float = 10.0) -> None:
        """`timeout_s` bounds a connect and a connection's silence: once the oldest
        unanswered call is older than that, the next call replaces the connection
        (the pending calls fail), as redis-py's `socket_timeout` does."""
        if urlparse(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("unsupported Redis URL scheme (redis://, rediss:// or unix://)")
        opts = parse_url(url)  # redis-py's own parsing: the clients agree on every URL
        unsupported = set(opts) - {"host", "port", "path", "db", "username", "password",
                                   "connection_class", *_SSL_OPTIONS}
        if unsupported:
            raise ValueError(f"unsupported Redis URL options: {sorted(unsupported)}")
        self._unix = opts.get("path")
        self._host, self._port = opts.get("host") or "127.0.0.1", opts.get("port") or 6379
        self._ssl = _ssl_context(opts) if urlparse(url).scheme == "rediss" else None
        self._db = int(opts.get("db") or 0)
        self._auth = [a for a in (opts.get("username"), opts.get("password")) if a is not None]
        self.timeout_s = timeout_s
        self.health_check_interval_s = health_check_interval_s
        self._proto: _Protocol | None = None
        self._establishing: asyncio.Task | None = None
        self._last_used = 0.0

    def _where(self) -> str:
        return self._unix or f"{self._host}:{self._port}"

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
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
            async with asyncio.timeout(self.timeout_s):
                raise_first(await asyncio.gather(
                    *proto.send(b"".join(map(encode_command, setup)), len(setup)),
                    return_exceptions=True))
        except BaseException as err:
            proto.fail(RedisConnectionError("connection setup failed"))
            if isinstance(err, TimeoutError):
                raise RedisConnectionError(f"Redis at {self._where()} did not answer") from None
            raise
        return proto

    async def _establish(self) -> _Protocol:
        """A working connection: the current one if a PING shows it still answers
        (it was idle), else a new one."""
        proto = self._proto
        if proto is not None and proto.lost is None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await proto.send(encode_command(("PING",)), 1)[0]
                return proto
            except (RedisConnectionError, TimeoutError):
                proto.fail(RedisConnectionError("Redis did not answer a health check"))
        self._proto = await self._connect()
        return self._proto

    async def _ready(self, deadline: float | None) -> _Protocol:
        now = time.monotonic()
        proto = self._proto
        if proto is not None and proto.lost is None:
            if proto.stalled(now, self.timeout_s):
                proto.fail(RedisConnectionError(
                    f"Redis did not answer for {self.timeout_s:g} s: connection replaced"))
            elif now - self._last_used < self.health_check_interval_s:
                self._last_used = now
                return proto
        if deadline is None:
            return await self._establish_shared()
        async with asyncio.timeout(deadline - now):
            return await self._establish_shared()

    async def _establish_shared(self) -> _Protocol:
        if self._establishing is None or self._establishing.done():
            # one shared attempt, shielded: a caller's own deadline must not cancel
            # a connect (or a health check) that the next callers then wait for
            task = asyncio.get_running_loop().create_task(self._establish())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
            self._establishing = task
        proto = await asyncio.shield(self._establishing)
        self._last_used = time.monotonic()
        return proto

    async def call(self, *args: Arg, deadline: float | None = None) -> Any:
        return (await self.pipeline([args], deadline=deadline))[0]

    async def pipeline(self, commands: list[tuple[Arg, ...]], return_exceptions: bool = False,
                       deadline: float | None = None) -> list[Any]:
        """Replies of all `commands`, sent in one write; the first error is raised,
        or with `return_exceptions` each error takes its reply's place. A
        `deadline` passed raises TimeoutError."""
        if not commands:
            return []
        proto = await self._ready(deadline)
        futs = proto.send(b"".join(map(encode_command, commands)), len(commands))
        timer = None if deadline is None else proto.loop.call_later(
            deadline - time.monotonic(), _expire, futs)
        try:
            if len(futs) == 1:  # (no gather: the common case, a lookup)
                try:
                    done = [await futs[0]]
                except (RedisConnectionError, ResponseError) as err:
                    done = [err]
            else:
                done = await asyncio.gather(*futs, return_exceptions=True)  # each retrieved
        finally:
            if timer is not None:
                timer.cancel()
        if any(isinstance(r, TimeoutError) for r in done):
            raise TimeoutError("Redis did not answer before the deadline")
        if not return_exceptions:
            raise_first(done)
        return done

    async def aclose(self) -> None:
        if self._establishing is not None:
            self._establishing.cancel()
        if self._proto is not None:
            self._proto.fail(RedisConnectionError("client closed"))
        self._proto = None


def _expire(futs: list[asyncio.Future]) -> None:
    for f in futs:
        if not f.done():
            f.set_exception(TimeoutError("Redis did not answer before the deadline"))


def raise_first(replies: list[Any]) -> None:
    """Raise the first exception among `replies` (those gathered with `return_exceptions`)."""
    for r in replies:
        if isinstance(r, BaseException):
            raise r
