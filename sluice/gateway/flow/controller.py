"""Flow control: which request goes to a saturated pool next, and which waits or is shed."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from sluice.gateway.flow.config import FlowControlConfig
from sluice.gateway.flow.metrics import FlowMetrics
from sluice.gateway.flow.queues import Item, PoolQueues

log = logging.getLogger("sluice.gateway.flow")

SHED_REASONS = ("capacity", "ttl", "evicted", "sheddable")


@dataclass(frozen=True, slots=True)
class Admitted:
    waited_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Shed:
    reason: str         # one of SHED_REASONS
    retry_after_s: int  # >= 1: when the queue ahead should have drained
    waited_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.reason in SHED_REASONS and self.retry_after_s >= 1, self

    @property
    def status(self) -> int:
        """GIE's translation: a request that waited out its TTL is 503; refused for
        room, or for saturation, 429."""
        return 503 if self.reason == "ttl" else 429


AT_ONCE = Admitted()


class FlowController:
    """Admission to saturated pools, GIE's flow control (`pkg/epp/flowcontrol`).

    1. A request is admitted at once when nothing of its pool waits at its priority or
       above and the pool is not saturated for its priority (`saturated(p)`: the
       pool's saturation against the priority's usage limit, `FlowControlConfig
       .ceiling`): the fast path, O(1), no queue touched.
    2. Else a sheddable request (priority < 0, `shed_sheddable`) of a saturated pool is
       shed (429).
    3. Else it waits in its priority's band, in its tenant's FIFO, if its band has room
       (`max_requests`, `max_bytes`) and the pool has room, or can make it by evicting
       the newest requests of the lowest priorities strictly below its own
       ("evicted"; if even all of them would not do, it is shed itself, "capacity"). A
       full round-robin band makes room by evicting the newest request of the tenant
       with the most waiting, when it has two more than the newcomer's (else the
       newcomer is shed): one tenant's flood cannot shut the others out of the band.
    4. A pool's dispatcher runs while requests wait: while `saturated(p)` (the latest
       admit()'s callable) says no for the priority p of the next request, it releases
       it: the highest band first, within a band by its fairness policy
       (`queues.Band`); the next request waits (head of line) while its priority is
       over its limit. It calls `saturated` again after each: a detector that counts
       the picker's in-flight
       requests stops it after the right number (one that reads only scraped load lets
       every waiting request go until the next scrape). It looks again every
       `poll_interval_s`, on `notify(pool)` and on each new arrival.
    5. A request that waits `default_request_ttl_s` is shed ("ttl", 503); one whose
       caller is cancelled leaves its queue at once.

    Every admit() ends once: Admitted, Shed, or the caller's CancelledError; in each case
    the request has left every queue. Runs on one event loop: no locks."""

    def __init__(self, config: FlowControlConfig = FlowControlConfig(),
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.metrics = FlowMetrics(registry if registry is not None else CollectorRegistry())
        self.clock = clock
        self.pools: dict[str, PoolQueues] = {}
        self._seq = itertools.count()

    async def admit(self, pool: str, priority: int, tenant: str,
                    saturated: Callable[[int], bool], size: int = 0,
                    on_dispatch: Callable[[], None] | None = None) -> Admitted | Shed:
        """`saturated(p)`: whether the pool is too busy for a request of priority p (its
        usage limit). `on_dispatch`: called when a queued request is released, before
        the dispatcher checks `saturated` again (so that it can count the request, which
        has not reached a pod yet)."""
        q = self.pools.get(pool)
        sat = None
        if q is None or q.ahead(priority) == 0:
            if not saturated(priority):
                self.metrics.ended(pool, priority, "dispatched", 0.0)
                return AT_ONCE
            sat = True
        if priority < 0 and self.config.shed_sheddable and (sat or saturated(priority)):
            return self._refuse(pool, priority, "sheddable", q)
        assert size >= 0, size
        if q is None:
            q = self.pools[pool] = PoolQueues(pool, self.config)
        band = q.band(priority)
        if band.fits(size):
            victims = q.victims(priority, size)
        else:  # (its band is full: room only at the expense of a tenant with more queued)
            victim = band.fair_victim(tenant)
            victims = None if victim is None or victim.size < size else [victim]
        if victims is None:
            return self._refuse(pool, priority, "capacity", q)
        for v in victims:
            self._end(q, v, "evicted")
        loop = asyncio.get_running_loop()
        item = Item(next(self._seq), tenant, priority, size, self.clock(), loop.create_future(),
                    on_dispatch=on_dispatch)
        q.push(item)
        self.metrics.queued(pool, priority, size, +1)
        if self.config.default_request_ttl_s:
            item.timer = loop.call_later(self.config.default_request_ttl_s, self._expire, q, item)
        q.saturated = saturated
        self._kick(q)
        try:
            return await item.future
        except asyncio.CancelledError:
            if q.holds(item):  # (the dispatcher may have met it, cancelled, first)
                self._end(q, item, "cancelled")
            raise

    def notify(self, pool: str) -> None:
        """A request of `pool` finished: room may have opened; look now."""
        q = self.pools.get(pool)
        if q is not None and q.task is not None:
            q.wake.set()

    def queued(self, pool: str) -> int:
        q = self.pools.get(pool)
        return q.total if q is not None else 0

    async def close(self) -> None:
        """Shed every waiting request ("evicted") and stop the dispatchers."""
        for q in self.pools.values():
            while q.total:
                self._end(q, q.pick(), "evicted")
            if q.task is not None:
                q.task.cancel()
                await asyncio.gather(q.task, return_exceptions=True)

    def check_invariants(self) -> None:
        for q in self.pools.values():
            q.check_invariants()

    def _kick(self, q: PoolQueues) -> None:
        if q.task is None:
            q.task = asyncio.get_running_loop().create_task(self._dispatch(q))
        else:
            q.wake.set()

    async def _dispatch(self, q: PoolQueues) -> None:
        try:
            while q.total:
                self._release(q)
                if not q.total:
                    break
                q.wake.clear()
                try:
                    await asyncio.wait_for(q.wake.wait(), self.config.poll_interval_s)
                except TimeoutError:
                    pass
        finally:
            q.task = None

    def _release(self, q: PoolQueues) -> None:
        while q.total:
            try:
                if q.saturated(q.top_priority()):  # (head of line: the next one waits)
                    return
            except Exception:  # the detector's bug must not strand the queue: fail open
                log.exception("saturation check of pool %r failed; releasing", q.name)
            item = q.pick()
            if item.future.done():  # cancelled; its task has not run its cleanup yet
                self._end(q, item, "cancelled")
                continue
            q.released(self.clock())
            self._end(q, item, "dispatched")
            if item.on_dispatch is not None:
                item.on_dispatch()

    def _expire(self, q: PoolQueues, item: Item) -> None:
        if q.holds(item):
            self._end(q, item, "ttl")

    def _end(self, q: PoolQueues, item: Item, reason: str) -> None:
        """`item` leaves its queue with its outcome; its caller is woken with it."""
        q.remove(item)
        self.metrics.queued(q.name, item.priority, item.size, -1)
        if item.timer is not None:
            item.timer.cancel()
        waited = self.clock() - item.enqueued
        self.metrics.ended(q.name, item.priority, reason, waited)
        if item.future.done():
            return
        if reason == "dispatched":
            item.future.set_result(Admitted(waited))
        else:
            item.future.set_result(Shed(reason, self._retry_after(q, item.priority), waited))

    def _refuse(self, pool: str, priority: int, reason: str, q: PoolQueues | None) -> Shed:
        self.metrics.ended(pool, priority, reason, 0.0)
        return Shed(reason, self._retry_after(q, priority))

    def _retry_after(self, q: PoolQueues | None, priority: int) -> int:
        """The time the requests ahead take to leave at the recent release rate."""
        if q is None or not q.drain_s:
            return 1
        est = math.ceil(q.ahead(priority) * q.drain_s)
        return min(max(1, est), self.config.max_retry_after_s)
