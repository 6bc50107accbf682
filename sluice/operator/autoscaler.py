"""The autoscaler loop body: one `tick(body)` per pool per round of the periodic loop.

For each role with autoscaling enabled: sample the engines' load, `decide` on the role's
own signal (`autoscale.SIGNALS`: prefill on waiting requests, decode on KV usage), and when
the replica count changes, write it through the pool's scale subresource (plain
pool) or `spec.roles.<role>.replicas` (prefill/decode pool) — the reconciler then
resizes the Deployment — and post an Event with the reason. The latest load and
`lastScaleTime` are written to the pool's status (in a prefill/decode pool, the KV usage
is the decode engines' and the queue depth the prefill engines'). Recommendation history lives in
memory per pool and role; after an operator restart the windows start empty, which
only delays (never hastens) a scale-down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sluice.operator import kube
from sluice.operator.autoscale import KV, QUEUE, SIGNALS, LoadSample, Recommendation, decide
from sluice.operator.reconciler import EventSink, utcnow
from sluice.operator.spec import PoolSpec, SpecError

log = logging.getLogger("sluice.operator")

# (status endpoints, role) -> LoadSample or None
Sampler = Callable[[list[dict[str, Any]], str], Awaitable[LoadSample | None]]


class Autoscaler:
    def __init__(self, client: kube.KubeClient, sampler: Sampler, events: EventSink,
                 clock: Callable[[], float] = time.monotonic, wallclock=utcnow):
        self.client, self.sampler, self.events = client, sampler, events
        self.clock, self.wallclock = clock, wallclock
        self.history: dict[tuple[str, str, str], tuple[Recommendation, ...]] = {}

    async def tick(self, body: Mapping[str, Any]) -> dict[str, int]:
        """Returns {role: new replicas} for the roles it scaled."""
        try:
            pool = PoolSpec.from_body(body)
        except SpecError:
            return {}
        if body["metadata"].get("deletionTimestamp"):
            return {}
        endpoints = list((body.get("status") or {}).get("endpoints") or [])
        scaled: dict[str, int] = {}
        status: dict[str, Any] = {}
        for role in pool.roles:
            if not role.autoscaling.enabled:
                continue
            sample = await self.sampler(endpoints, role.name)
            key = (pool.namespace, pool.name, role.name)
            decision = decide(role.autoscaling, role.replicas, sample,  # its own signal
                              self.history.get(key, ()), self.clock(), role.name)
            self.history[key] = decision.history
            if sample is not None:  # each role reports the signal it scales on
                if KV in SIGNALS[role.name]:
                    status["kvCacheUsage"] = round(sample.kv_cache_usage, 4)
                if QUEUE in SIGNALS[role.name]:
                    status["queueDepth"] = round(sample.queue_depth, 2)
            if decision.changes(role.replicas):
                await self._scale(pool, role.name, decision.replicas)
                self.events(body, "Normal", decision.reason, f"{role.name}: {decision.message}")
                status["lastScaleTime"] = self.wallclock()
                scaled[role.name] = decision.replicas
        if status:
            try:
                await self.client.patch(kube.POOLS, pool.namespace, pool.name,
                                        {"status": status}, subresource="status")
            except kube.NotFound:
                pass
        return scaled

    async def _scale(self, pool: PoolSpec, role: str, replicas: int) -> None:
        if not pool.disaggregated:
            await self.client.patch(kube.POOLS, pool.namespace, pool.name,
                                    {"spec": {"replicas": replicas}}, subresource="scale")
        else:
            await self.client.patch(kube.POOLS, pool.namespace, pool.name,
                                    {"spec": {"roles": {role: {"replicas": replicas}}}})
        log.info("scaled %s/%s %s to %d", pool.namespace, pool.name, role, replicas)
