"""Retry with exponential backoff for the passes kopf does not retry itself.

kopf retries a failed create/update/resume handler of the pool (`TemporaryError` with a
delay), but an `@kopf.on.event` handler's error is only logged: a 503 while repairing a
child deleted by hand would otherwise wait for the next resync (a minute). `Retrier.run`
runs such a pass; when it fails with a transient error (`kube.is_transient`: 409, 429,
5xx, a lost connection) it schedules the same pass again after 0.5, 1, 2, 4 … s (capped
at `max_s`), at most `attempts` times, then leaves the pool to the resync. Other errors
are not retried: they are the API server's final answer, reported as conditions by the
pass itself.

At most one retry is pending per pool: a newer failure replaces nothing, the pending
retry re-reads the pool anyway.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

from sluice.operator import kube

log = logging.getLogger("sluice.operator")


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    attempts: int = 8  # 0.5 + 1 + … + 30 + 30 ≈ 2 min: past the resync (60 s) by then
    jitter: float = 0.1  # ± fraction, so replicas of one failure do not retry in step

    def delay(self, retry: int) -> float:
        """Seconds before retry number `retry` (0 = the first retry)."""
        base = min(self.max_s, self.first_s * self.factor ** retry)
        return base * (1 + self.jitter * (2 * random.random() - 1))


class Retrier:
    """Owns the pending retry tasks, one per key at most; all on the operator's event loop."""

    def __init__(self, backoff: Backoff = Backoff(),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.backoff, self.sleep = backoff, sleep
        self._pending: dict[Hashable, asyncio.Task[None]] = {}
        self.retries = 0  # retries started (for tests and benchmarks)

    async def run(self, key: Hashable, attempt: Callable[[], Awaitable[None]]) -> None:
        """Run `attempt()` now; on a transient error, again later in the background."""
        try:
            await attempt()
        except Exception as e:
            if not kube.is_transient(e):
                raise
            self._schedule(key, attempt, e)

    def _schedule(self, key: Hashable, attempt: Callable[[], Awaitable[None]],
                  error: BaseException) -> None:
        if key in self._pending:
            return
        log.info("%s: %s; retrying with backoff", key, error)
        task = asyncio.get_running_loop().create_task(self._retry(key, attempt))
        self._pending[key] = task

    async def _retry(self, key: Hashable, attempt: Callable[[], Awaitable[None]]) -> None:
        try:
            for retry in range(self.backoff.attempts):
                await self.sleep(self.backoff.delay(retry))
                self.retries += 1
                try:
                    await attempt()
                    return
                except Exception as e:  # noqa: BLE001 -- sorted by is_transient
                    if not kube.is_transient(e):
                        log.warning("%s: %s (not retried)", key, e)
                        return
                    log.info("%s: retry %d failed: %s", key, retry + 1, e)
            log.warning("%s: still failing after %d retries; the resync takes over",
                        key, self.backoff.attempts)
        finally:
            self._pending.pop(key, None)

    def pending(self, key: Hashable) -> bool:
        return key in self._pending

    async def close(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
