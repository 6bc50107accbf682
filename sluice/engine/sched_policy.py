"""Scheduling policies (vLLM's `--scheduling-policy`): the order in which a step serves
requests and whom it preempts. Chosen by name at construction (`POLICIES`).

A request's priority follows vLLM: lower values are served first, 0 by default, ties by
arrival time.
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import chain
from typing import ClassVar, Protocol

from sluice.engine.request import Request


class SchedulingPolicy(Protocol):
    name: ClassVar[str]

    def add(self, waiting: deque[Request], req: Request) -> None:
        """Queue a new request."""

    def requeue(self, waiting: deque[Request], req: Request) -> None:
        """Queue a preempted request again."""

    def order(self, running: list[Request], waiting: deque[Request]
              ) -> list[tuple[Request, bool]]:
        """The step's requests in the order they get budget, seats and blocks, each with
        whether it was running at the step's start."""

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt when memory runs out. It comes last in
        `order` among the running requests not yet served this step."""

    def outranks(self, req: Request, victim: Request) -> bool:
        """Whether waiting `req` may preempt running `victim` for a seat or blocks."""

    def defers(self, req: Request, first_prefill: Request | None) -> bool:
        """Whether `req`'s prompt tokens wait for a later step because `first_prefill`
        (the first request that computes prompt tokens in this step) comes before it."""


class FCFS:
    """First come, first served (vLLM's default): running requests first, oldest first,
    then waiting ones in arrival order; memory pressure preempts the newest running
    request, which is queued first again; nobody is preempted for a waiting request."""

    name = "fcfs"

    def add(self, waiting: deque[Request], req: Request) -> None:
        waiting.append(req)

    def requeue(self, waiting: deque[Request], req: Request) -> None:
        waiting.appendleft(req)

    def order(self, running: list[Request], waiting: deque[Request]
              ) -> list[tuple[Request, bool]]:
        return [*((r, True) for r in running), *((r, False) for r in waiting)]

    def victim(self, running: list[Request]) -> Request:
        return running[-1]

    def outranks(self, req: Request, victim: Request) -> bool:
        return False

    def defers(self, req: Request, first_prefill: Request | None) -> bool:
        return False


def _key(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


class Priority:
    """Strict priority (vLLM's `priority`, with the waiting requests' claim made whole):
    - running and waiting requests are served together in (priority, arrival) order, so a
      waiting request of a higher priority takes the step's budget before running ones of
      a lower priority (vLLM serves every running request first);
    - memory pressure preempts the lowest-priority running request, newest first;
    - a waiting request that finds no seat (max_num_seqs) or no blocks preempts running
      requests of a strictly lower priority until it fits;
    - in a step that computes prompt tokens of a request, lower-priority requests compute
      none (their decodes go on): a step costs about what its tokens cost on a CPU, so a
      high-priority prompt's first token is not slowed by low-priority prefills.
    A low priority can starve while higher ones keep the engine busy; that is the point."""

    name = "priority"

    def add(self, waiting: deque[Request], req: Request) -> None:
        # (after every request of a key <= req's: equal keys keep their arrival order)
        bisect.insort_right(waiting, req, key=_key)

    requeue = add

    def order(self, running: list[Request], waiting: deque[Request]
              ) -> list[tuple[Request, bool]]:
        # (a stable sort: at equal keys running requests come first, in their list order)
        return sorted(chain(((r, True) for r in running), ((r, False) for r in waiting)),
                      key=lambda e: _key(e[0]))

    def victim(self, running: list[Request]) -> Request:
        # (max keeps the first of equal keys: from the end, the one `order` serves last)
        return max(reversed(running), key=_key)

    def outranks(self, req: Request, victim: Request) -> bool:
        return req.priority < victim.priority

    def defers(self, req: Request, first_prefill: Request | None) -> bool:
        return first_prefill is not None and req.priority > first_prefill.priority


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFS, Priority)}
