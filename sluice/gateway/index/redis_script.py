"""Calls from request handlers on redis-py's asyncio client: bounded by a deadline,
Lua scripts by EVALSHA with an EVAL fallback.

Contract:
- `deadline` (a `time.monotonic()` value) bounds a whole call: the wait for a
  pooled connection, a connect or health-check PING, the reply. Past it the call
  raises the builtin `TimeoutError`, and so does redis-py's own socket timeout
  (`redis.exceptions.TimeoutError`): the index counts either as a slow Redis,
  not as an outage (`PrefixIndex._timed_out`). A call abandoned mid-reply
  leaves no stale reply behind: redis-py closes a connection whose read was
  interrupted, and the pool connects again on its next use.
- Other failures are redis-py's: `ResponseError` for an error reply,
  `ConnectionError` for a lost or refused connection. No call is retried: the
  callers have their own fallback.
- `run_scripts` sends several script calls in one write (a pipeline without
  MULTI) and returns their replies in order; a NOSCRIPT reply (Redis restarted,
  or flushed its script cache) is answered by sending those calls again by
  EVAL, in one more write; any other error reply is raised, the first one first.
  Not redis-py's `register_script`: in a pipeline it sends SCRIPT EXISTS first,
  one more round trip on every flush, and after a NOSCRIPT it needs two (SCRIPT
  LOAD, EVALSHA) where EVAL takes one.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = bytes | str | int | float
T = TypeVar("T")


async def bounded(call: Awaitable[T], deadline: float) -> T:
    """`call`'s result, or the builtin TimeoutError once `deadline` passes."""
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            return await call
    except RedisTimeoutError as err:  # redis-py's socket timeout: slow, as a deadline is
        raise TimeoutError(f"Redis did not answer in time: {err}") from None


class Script:
    """A Lua script (ARGV only) run by EVALSHA, loaded with EVAL when Redis lacks it."""

    def __init__(self, client: Redis, source: str) -> None:
        self.client = client
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, args: Sequence[Arg], deadline: float) -> Any:
        return await bounded(self._run(args), deadline)

    async def _run(self, args: Sequence[Arg]) -> Any:
        # (not a pipeline of one: a lookup is the request path's call, and a plain
        # command costs less Python than a pipeline)
        try:
            return await self.client.execute_command("EVALSHA", self.sha, 0, *args)
        except NoScriptError:
            return await self.client.execute_command("EVAL", self.source, 0, *args)


async def run_scripts(client: Redis, calls: list[tuple[Script, Sequence[Arg]]],
                      deadline: float) -> list[Any]:
    """The replies of several script calls sent in one write (by EVALSHA; those
    Redis lacks, NOSCRIPT, again by EVAL); the first error is raised."""
    return await bounded(_run_scripts(client, calls), deadline)


async def _run_scripts(client: Redis, calls: list[tuple[Script, Sequence[Arg]]]) -> list[Any]:
    replies = await pipeline(client, [("EVALSHA", s.sha, 0, *a) for s, a in calls])
    missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
    if missing:
        again = await pipeline(client, [("EVAL", calls[i][0].source, 0, *calls[i][1])
                                        for i in missing])
        for i, r in zip(missing, again):
            replies[i] = r
    raise_first(replies)
    return replies


async def pipeline(client: Redis, commands: list[tuple[Arg, ...]]) -> list[Any]:
    """The replies of `commands`, sent in one write without MULTI; an error reply
    takes its reply's place (a `ResponseError`). Unbounded: see `bounded`."""
    pipe = client.pipeline(transaction=False)
    for cmd in commands:
        pipe.execute_command(*cmd)
    return await pipe.execute(raise_on_error=False)


def raise_first(replies: list[Any]) -> None:
    """Raise the first error reply among `replies`."""
    for r in replies:
        if isinstance(r, ResponseError):
            raise r
