"""Engine output streams as the HTTP handlers consume them: primed (errors surface before
the response starts), interleaved across choices, collected, or abandoned when the
client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request


async def prime(gen: AsyncIterator):
    """Wrap a generate() stream so its first await happens before the response starts."""
    first = await gen.__anext__()
    yield None  # primed: errors from the first step were raised above
    try:
        yield first
        async for out in gen:
            yield out
    finally:
        await gen.aclose()


async def merge(streams: list[AsyncIterator]):
    """Interleave several output streams as (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        # Wait for the pumps to stop: the caller closes the streams next, and closing
        # one a pump is still iterating raises "aclose(): ... already running" (found
        # by schemathesis: a client gone from a streamed n > 1 request).
        await asyncio.wait(tasks)


async def collect(streams, choices) -> None:
    async for i, out in merge(streams):
        choices[i].add(out)


async def finished_before_disconnect(raw: Request, work: asyncio.Future) -> bool:
    """Wait for `work`; if the client goes away first, cancel it (aborting the requests)."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=0.1)
        if done:
            work.result()
            return True
        if await raw.is_disconnected():
            work.cancel()
            return False
