"""One pool's waiting requests: a band per priority, a FIFO per tenant within a band.

Ownership invariants (`PoolQueues.check_invariants`): every waiting item is in exactly
one tenant FIFO, that of its own tenant in the band of its own priority, and in that
band's arrival order; counts and byte sums of bands and pool match their items. Every
operation here is O(1) but `victims` (O(items it evicts)) and the band scans (O(bands),
a handful).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sluice.gateway.flow.config import GLOBAL_STRICT, FlowControlConfig, PriorityBandConfig


@dataclass(eq=False, slots=True)
class Item:
    """One admit() call that waits."""

    seq: int
    tenant: str
    priority: int
    size: int
    enqueued: float  # monotonic seconds
    future: asyncio.Future
    timer: asyncio.TimerHandle | None = None  # its TTL
    on_dispatch: Callable[[], None] | None = None  # called as it is released


class Band:
    """The waiting requests of one priority. Fairness between tenants:
    `round-robin-fairness-policy` serves the tenants in turn, one request per turn, a
    tenant re-entering the turn at its end; `global-strict-fairness-policy` serves the
    band's oldest request, whoever's. Within a tenant: first come, first served (fcfs)."""

    def __init__(self, cfg: PriorityBandConfig) -> None:
        self.cfg = cfg
        self.flows: OrderedDict[str, OrderedDict[int, Item]] = OrderedDict()  # turn order
        self.items: OrderedDict[int, Item] = OrderedDict()  # arrival order
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def fits(self, size: int) -> bool:
        return ((not self.cfg.max_requests or len(self.items) + 1 <= self.cfg.max_requests)
                and (not self.cfg.max_bytes or self.bytes + size <= self.cfg.max_bytes))

    def push(self, item: Item) -> None:
        assert item.seq not in self.items and item.priority == self.cfg.priority
        self.items[item.seq] = item
        self.flows.setdefault(item.tenant, OrderedDict())[item.seq] = item
        self.bytes += item.size

    def remove(self, item: Item) -> None:
        del self.items[item.seq]
        fifo = self.flows[item.tenant]
        del fifo[item.seq]
        if not fifo:
            del self.flows[item.tenant]
        self.bytes -= item.size

    def fair_victim(self, tenant: str) -> Item | None:
        """Round-robin bands, full: the newest request of the tenant with the most
        waiting, when it has at least two more than `tenant` (whose new request would
        take its place): a flooding tenant fills the band, never shuts the others out.
        None: the newcomer is the one to refuse."""
        if self.cfg.fairness_policy == GLOBAL_STRICT or not self.flows:
            return None
        top, fifo = max(self.flows.items(), key=lambda kv: len(kv[1]))
        mine = len(self.flows.get(tenant, ()))
        if top == tenant or len(fifo) < mine + 2:
            return None
        return next(reversed(fifo.values()))

    def pick(self) -> Item:
        """The next request to serve (the caller removes it); the band is not empty."""
        if self.cfg.fairness_policy == GLOBAL_STRICT:
            return next(iter(self.items.values()))
        tenant, fifo = next(iter(self.flows.items()))
        self.flows.move_to_end(tenant)  # its turn is used
        return next(iter(fifo.values()))


class PoolQueues:
    """All bands of one pool, under the pool's limits (`max_requests`, `max_bytes`)."""

    def __init__(self, name: str, cfg: FlowControlConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.bands: dict[int, Band] = {}
        self.order: list[int] = []  # priorities, highest first
        self.total = 0
        self.bytes = 0
        # the latest admit()'s: is the pool too busy for a request of this priority?
        self.saturated: Callable[[int], bool] = lambda priority: True
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None  # the dispatcher, while items wait
        self.drain_s = 0.0  # mean time between releases (EWMA): Retry-After's estimate
        self.last_release = 0.0

    def band(self, priority: int) -> Band:
        b = self.bands.get(priority)
        if b is None:
            b = self.bands[priority] = Band(self.cfg.band(priority))
            self.order = sorted(self.bands, reverse=True)
        return b

    def ahead(self, priority: int) -> int:
        """Requests waiting at `priority` or above: a new one would be served after them."""
        if not self.total:
            return 0
        return sum(len(self.bands[p]) for p in self.order if p >= priority)

    def holds(self, item: Item) -> bool:
        b = self.bands.get(item.priority)
        return b is not None and item.seq in b.items

    def victims(self, priority: int, size: int) -> list[Item] | None:
        """The requests to evict so that one more (`priority`, `size`) fits the pool's
        limits: the newest of the lowest priority strictly below first. [] when it fits
        as is; None when evicting every lower one would not make room."""
        need_n = self.total + 1 - self.cfg.max_requests if self.cfg.max_requests else 0
        need_b = self.bytes + size - self.cfg.max_bytes if self.cfg.max_bytes else 0
        out: list[Item] = []
        for p in reversed(self.order):
            if need_n <= 0 and need_b <= 0:
                break
            if p >= priority:
                break
            for item in reversed(self.bands[p].items.values()):
                if need_n <= 0 and need_b <= 0:
                    break
                out.append(item)
                need_n -= 1
                need_b -= item.size
        return out if need_n <= 0 and need_b <= 0 else None

    def push(self, item: Item) -> None:
        self.band(item.priority).push(item)
        self.total += 1
        self.bytes += item.size

    def remove(self, item: Item) -> None:
        self.bands[item.priority].remove(item)
        self.total -= 1
        self.bytes -= item.size

    def top_priority(self) -> int:
        """The priority of the next request to serve. The pool is not empty."""
        return next(p for p in self.order if self.bands[p].items)

    def pick(self) -> Item:
        """The next request to serve: the highest band's pick. The pool is not empty."""
        for p in self.order:
            b = self.bands[p]
            if b.items:
                return b.pick()
        raise AssertionError(f"pick() on an empty pool {self.name!r}")

    def released(self, now: float) -> None:
        if self.last_release:
            dt = min(now - self.last_release, 10.0)  # a long quiet spell is not the rate
            self.drain_s = dt if not self.drain_s else 0.9 * self.drain_s + 0.1 * dt
        self.last_release = now

    def check_invariants(self) -> None:
        seen: set[int] = set()
        assert self.order == sorted(self.bands, reverse=True)
        for p, b in self.bands.items():
            assert b.cfg.priority == p
            assert sum(len(f) for f in b.flows.values()) == len(b.items)
            assert b.bytes == sum(i.size for i in b.items.values())
            for tenant, fifo in b.flows.items():
                assert fifo, f"empty FIFO of {tenant!r} kept in band {p}"
                for seq, item in fifo.items():
                    assert item.tenant == tenant and item.priority == p
                    assert b.items.get(seq) is item and seq not in seen
                    assert not item.future.done() or item.future.cancelled()
                    seen.add(seq)
        assert self.total == len(seen) == sum(len(b) for b in self.bands.values())
        assert self.bytes == sum(b.bytes for b in self.bands.values())
