"""Requests sent to engine pods: the router's in-flight signals, per pod.

- `inflight[pod]`: requests sent there and not finished.
- `pending_prefill[pod]`: uncached prompt tokens of those whose answer has not
  begun (their prefill is still running or queued).
- While a request's prefill is pending, its routing decision's speculative index
  entries are renewed every `renew_every_s` (`renew`): a prefill can outlast
  their TTL on a loaded engine, and once they lapse the next request of the same
  prefix would go to another pod and prefill it again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sluice.gateway.routing.scheduler import Decision


class InFlight:
    def __init__(self, renew: Callable[[Decision], None] | None = None,
                 renew_every_s: float = 1.0) -> None:
        assert renew_every_s > 0
        self.renew = renew
        self.renew_every_s = renew_every_s
        self.inflight: dict[str, int] = {}
        self.pending_prefill: dict[str, int] = {}
        # looked up once, not per request: in Python 3.11 each lookup is a getpid syscall
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, d: Decision) -> Attempt:
        """`d`'s request is being sent to `d.pod`."""
        return Attempt(self, d)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.call_later(delay_s, fn)

    def _add(self, table: dict[str, int], pod: str, n: int) -> None:
        left = table.get(pod, 0) + n
        assert left >= 0, (pod, left)
        if left:
            table[pod] = left
        else:
            table.pop(pod, None)


class Attempt:
    """One request on one pod; `prefilled()` and `done()` may be called repeatedly."""

    def __init__(self, table: InFlight, d: Decision) -> None:
        self.table, self.d = table, d
        self.owed = d.prefill_tokens
        self.finished = False
        table._add(table.inflight, d.pod, 1)
        table._add(table.pending_prefill, d.pod, self.owed)
        self._timer: asyncio.TimerHandle | None = None
        if d.spec_keys and table.renew is not None:
            self._timer = table.call_later(table.renew_every_s, self._renew)

    def _renew(self) -> None:
        assert self.table.renew is not None
        self.table.renew(self.d)
        self._timer = self.table.call_later(self.table.renew_every_s, self._renew)

    def prefilled(self) -> None:
        """The answer began (or the request ended): its prefill is no longer pending."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.owed:
            self.table._add(self.table.pending_prefill, self.d.pod, -self.owed)
            self.owed = 0

    def done(self) -> None:
        """The request left the pod."""
        self.prefilled()
        if not self.finished:
            self.finished = True
            self.table._add(self.table.inflight, self.d.pod, -1)
