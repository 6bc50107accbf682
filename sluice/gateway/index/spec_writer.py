"""Speculative entries written to Redis behind the decisions that made them.

A routing decision's entries go to Redis batched with the other decisions of
`flush_after_s` (`PrefixIndex.speculate` says why): the first decision of an
interval arms a timer; when it fires, one `RedisIndex.flush` sends them all,
off the request path. How a failed write counts (a slow Redis, an outage, or a
refusal that is neither) is the index's to say: `on_timeout`, `on_error`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError, ResponseError

from sluice.gateway.index.redis_index import RedisIndex

log = logging.getLogger("sluice.gateway.index")


class SpeculationWriter:
    def __init__(self, redis: RedisIndex, flush_after_s: float, timeout_s: float,
                 on_timeout: Callable[[], None],
                 on_error: Callable[[RedisError], None]) -> None:
        assert flush_after_s > 0 and timeout_s > 0
        self.redis = redis
        self.flush_after_s = flush_after_s
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.on_error = on_error
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    def add(self, pod: str, keys: list[str], ttl_ms: int, now_ms: float) -> None:
        """(Event loop) queue `pod`'s entries for `keys`, written within `flush_after_s`."""
        self.redis.speculate_later(pod, keys, ttl_ms, now_ms)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_after_s,
                                                                self._flush_now)

    def _flush_now(self) -> None:
        self._timer = None
        if self.redis.pending:
            task = asyncio.get_running_loop().create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        try:
            await self.redis.flush(time.monotonic() + self.timeout_s)
        except TimeoutError:
            self.on_timeout()
        except ResponseError as err:  # Redis answered: no outage (e.g. an ACL refusal)
            log.warning("speculative entries refused by redis: %s", err)
        except (RedisError, OSError) as err:
            self.on_error(err if isinstance(err, RedisError) else RedisError(repr(err)))
