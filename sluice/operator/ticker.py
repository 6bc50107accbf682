"""The operator's periodic work: autoscaling, and the resync safety net, for every pool.

Not kopf timers: kopf puts its finalizer on every object a timer runs for (to stop the
timer before the object goes), so every pool would hang in Terminating once the operator
is uninstalled, even with no index to clean. One loop instead, a round every `tick_s`
(the shorter of the two intervals):

1. nothing unless this replica acts (`peering.is_acting`, kopf's own rule);
2. list the pools: one LIST per watched namespace, or one for the cluster;
3. per pool, concurrently (at most `max_concurrent`): the autoscaler's tick once
   `autoscale_interval_s` has passed since the last; a full pass (orphans included) when
   no pass ran for `resync_interval_s` (`Reconciler.idle_for`), so the resync adds no load
   to pools that events keep fresh.

A failing round (API server down) is logged; the next one runs on time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from sluice.operator import crd, kube, peering
from sluice.operator.autoscaler import Autoscaler
from sluice.operator.config import OperatorConfig
from sluice.operator.reconciler import Reconciler

log = logging.getLogger("sluice.operator")


class Ticker:
    """Owns the loop's schedule; runs as one task on the operator's event loop."""

    def __init__(self, client: kube.KubeClient, config: OperatorConfig, reconciler: Reconciler,
                 autoscaler: Autoscaler, max_concurrent: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.config = client, config
        self.reconciler, self.autoscaler = reconciler, autoscaler
        self.max_concurrent, self.clock = max_concurrent, clock
        self._last_autoscale = float("-inf")
        self.rounds = 0  # rounds this replica acted in (for tests)

    @property
    def tick_s(self) -> float:
        return min(self.config.autoscale_interval_s, self.config.resync_interval_s)

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.round()
            except Exception as e:  # noqa: BLE001 -- the next round retries on time
                log.warning("periodic round failed: %s", e)

    async def round(self) -> None:
        if not await peering.is_acting(self.client, self.config):
            return
        self.rounds += 1
        pools = await self._pools()
        now = self.clock()
        due = self.config.autoscale_interval_s - 0.05 * self.tick_s  # (a round may be early)
        autoscale = now - self._last_autoscale >= due
        if autoscale:
            self._last_autoscale = now
        gate = asyncio.Semaphore(self.max_concurrent)

        async def one(body: Mapping[str, Any]) -> None:
            meta = body["metadata"]
            async with gate:
                if autoscale:
                    await self.autoscaler.tick(body)
                if (self.reconciler.idle_for(meta["namespace"], meta["name"])
                        >= 0.9 * self.config.resync_interval_s):
                    await self.reconciler.reconcile(body, full=True)

        results = await asyncio.gather(*(one(b) for b in pools), return_exceptions=True)
        for body, result in zip(pools, results):
            if isinstance(result, Exception):
                meta = body["metadata"]
                log.warning("periodic work on %s/%s failed: %s", meta["namespace"],
                            meta["name"], result)

    async def _pools(self) -> list[dict[str, Any]]:
        namespaces: tuple[str | None, ...] = (None,) if self.config.clusterwide else \
            self.config.namespaces
        pools = []
        for namespace in namespaces:
            for item in await self.client.list(kube.POOLS, namespace):
                # list items may omit apiVersion/kind; Events and the spec parser need them
                pools.append({"apiVersion": crd.API_VERSION, "kind": crd.KIND, **item})
        return pools
