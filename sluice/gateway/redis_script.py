"""Lua scripts on a `RespClient`: EVALSHA, loaded by EVAL when Redis lacks them.

Contract: `run_scripts` sends several script calls in one write and returns
their replies in order; a NOSCRIPT reply (Redis restarted, or flushed its
script cache) is answered by sending those calls again by EVAL, in one more
write; any other error reply is raised, the first one first."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from sluice.gateway.resp_client import Arg, RespClient, raise_first


class Script:
    """A Lua script (ARGV only) run by EVALSHA, loaded with EVAL when Redis lacks it."""

    def __init__(self, client: RespClient, source: str) -> None:
        self.client = client
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, args: Sequence[Arg], deadline: float | None = None) -> Any:
        return (await run_scripts(self.client, [(self, args)], deadline))[0]


async def run_scripts(client: RespClient, calls: list[tuple[Script, Sequence[Arg]]],
                      deadline: float | None = None) -> list[Any]:
    """The replies of several script calls sent in one write (by EVALSHA; those
    Redis lacks, NOSCRIPT, again by EVAL); the first error is raised."""
    replies = await client.pipeline([("EVALSHA", s.sha, 0, *a) for s, a in calls],
                                    return_exceptions=True, deadline=deadline)
    missing = [i for i, r in enumerate(replies)
               if isinstance(r, ResponseError) and str(r).startswith("NOSCRIPT")]
    if missing:
        again = await client.pipeline([("EVAL", calls[i][0].source, 0, *calls[i][1])
                                       for i in missing], return_exceptions=True,
                                      deadline=deadline)
        for i, r in zip(missing, again):
            replies[i] = r
    raise_first(replies)
    return replies
