"""Admission of a request to its pool when the pool is saturated (GIE's admission and
flow control), before the picker tokenizes and schedules it.

1. Priority and tenant come from the request (`flow.objectives`).
2. Saturation, over the pool's decode-capable pods, by the plan's saturation detector
   (`flow.saturation`): `utilization-detector` (waiting queue and KV usage against
   thresholds; a pod's waiting queue is judged as the larger of its scraped one and
   this picker's requests in flight to it beyond those it was seen running: the
   in-flight count moves at once, a scrape only every 150 ms, so a burst admitted on
   one scrape would otherwise overrun the pool), or `concurrency-detector` (this
   picker's requests in flight over `maxConcurrency` per pod). A request of priority p
   is held while the saturation reaches p's usage limit (`FlowControlConfig.ceiling`,
   1 without flow control): with limit 1 and the utilization detector, while no pod
   has room (GIE's rule); below 1, while GIE's saturation score reaches it.
3. With flow control on (the configuration's `flowControl`, feature gate
   `flowControl`): the request waits its turn while the pool is saturated, highest
   priority first and tenants in turn, or is shed with 429 (503 when it waited out its
   TTL) and Retry-After (`flow.controller`).
4. Without it (GIE's admission): a sheddable request (priority < 0) of a saturated pool
   is refused with 429; others pass. The plan's admitters (`probabilistic-admitter`)
   may refuse sheddable requests before that.
A request released from a queue is *placing* until the picker has started it on a pod
(`placed`): it counts as in flight (concurrency detector), or its pool as saturated while
it places (utilization detector), so one freed slot releases one request, not every
request queued before the in-flight count catches up. A finished
request tells flow control that its pool may have room (`finished`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from sluice.gateway.core import RoutingCore
from sluice.gateway.flow.controller import FlowController, Shed
from sluice.gateway.flow.objectives import fairness_id
from sluice.gateway.flow.saturation import ConcurrencyDetectorConfig, SaturationDetector


class Admission:
    def __init__(self, core: RoutingCore) -> None:
        self.core = core
        plan = core.plan
        cfg = plan.saturation_detector
        self.concurrency = cfg if isinstance(cfg, ConcurrencyDetectorConfig) else None
        self.detector = None if self.concurrency else SaturationDetector(cfg)
        self.flow = (FlowController(plan.flow_control, core.metrics.registry)
                     if plan.flow_control is not None else None)
        self.admitters = [p for p in plan.plugins.values() if hasattr(p, "admit_sheddable")]
        self._placing: dict[str, int] = {}  # model -> released requests not yet started

    def rows(self, pods: list[str]) -> list[dict[str, float] | None]:
        """The pods' load rows, their waiting queues raised to this picker's in-flight
        requests beyond the running ones (see the module docstring, 2)."""
        core, now = self.core, time.time() * 1000.0
        out: list[dict[str, float] | None] = []
        for p in pods:
            row = core.loads.row(p, now)
            if row is not None:
                extra = core.flight.inflight.get(p, 0) - row["running"]
                if extra > row["waiting"]:
                    row = {**row, "waiting": float(extra)}
            out.append(row)
        return out

    def saturated(self, model: str, pods: list[str], priority: int = 0) -> bool:
        """Whether a request of `priority` must wait (see the module docstring, 2)."""
        ceiling = self.flow.config.ceiling(priority) if self.flow is not None else 1.0
        placing = self._placing.get(model, 0)
        if self.concurrency is not None:  # (a released request counts before its pod)
            flight = self.core.flight.inflight
            return self.concurrency.score(sum(flight.get(p, 0) for p in pods) + placing,
                                          len(pods)) >= ceiling
        if placing:  # (one released request at a time until it is on a pod)
            return True
        now = time.time() * 1000.0
        if ceiling >= 1.0:
            return self.detector.saturated(self.rows(pods), now)
        return self.detector.score(self.rows(pods), now) >= ceiling

    async def admit(self, model: str, pods: list[str], api_key: str | None,
                    headers: Mapping[str, str], size: int, priority: int) -> Shed | bool:
        """A Shed: why the request is refused (see the module docstring); else whether it
        was queued (then the caller calls `placed(model)` once it started or failed).
        `priority`: the request's (`flow.objectives`)."""
        if self.flow is not None:
            dispatched = False

            def placing() -> None:
                nonlocal dispatched
                dispatched = True
                self._placing[model] = self._placing.get(model, 0) + 1

            try:
                got = await self.flow.admit(
                    model, priority, fairness_id(api_key, headers),
                    lambda p: self.saturated(model, pods, p), size, placing)
            except asyncio.CancelledError:  # (released, then the client went away)
                if dispatched:
                    self.placed(model)
                raise
            return got if isinstance(got, Shed) else dispatched
        if priority >= 0:
            return False
        if any(not a.admit_sheddable(self.rows(pods)) for a in self.admitters):
            return Shed("sheddable", 1)
        return Shed("sheddable", 1) if self.saturated(model, pods, priority) else False

    def placed(self, model: str) -> None:
        """A request released from the queue was started on a pod, or refused."""
        n = self._placing[model] - 1
        assert n >= 0, model
        if n:
            self._placing[model] = n
        else:
            del self._placing[model]
        self.finished(model)

    def finished(self, model: str) -> None:
        if self.flow is not None:
            self.flow.notify(model)

    async def close(self) -> None:
        if self.flow is not None:
            await self.flow.close()
