"""Level-based reconciliation of one InferencePool: render → apply → observe → status.

`Reconciler.reconcile(body)` may be called from any trigger (pool created, updated
or resumed, a child changed, the periodic resync). Calls for the same pool are
serialised, and triggers that arrive while one runs are coalesced into one more pass,
so a burst of child events costs at most two passes. Every pass is idempotent.
A spec the operator cannot render, or a problem only it can see, becomes a Degraded
condition and an Event, never an exception loop.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sluice.operator import apply, kube, render_epp, render_gie
from sluice.operator.lora import LoraSyncer
from sluice.operator.observe import observe
from sluice.operator.render import RenderConfig, render_pool
from sluice.operator.render_gie import GieConfig
from sluice.operator.spec import PoolSpec, SpecError
from sluice.operator.status import compute_status, invalid_spec_status, same_status

log = logging.getLogger("sluice.operator")

# (pool body, "Normal" | "Warning", reason, message) → posts a Kubernetes Event.
EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Slot:
    lock: asyncio.Lock
    pending: bool = False


class Reconciler:
    def __init__(self, client: kube.KubeClient, config: RenderConfig, events: EventSink,
                 clock: Callable[[], str] = utcnow, max_concurrent: int = 16,
                 gie: GieConfig | None = None, loras: LoraSyncer | None = None):
        self.client, self.config, self.events, self.clock = client, config, events, clock
        self.gie = gie  # GIE mode: also a GIE InferencePool per pool (render_gie)
        self.loras = loras  # loads spec.loras into the ready engines (lora.py); None: never
        # Bounded concurrency: passes beyond this wait (and coalesce) instead of piling
        # requests onto the API server and the connection pool.
        self.max_concurrent = max_concurrent
        self._gate: asyncio.Semaphore | None = None
        self._slots: dict[tuple[str, str], _Slot] = {}
        # (uid, generation) last pruned per pool: orphans appear only when the spec
        # changes, so child events (drift, readiness) skip the three list calls.
        self._pruned: dict[tuple[str, str], tuple[str, int]] = {}
        self._last_pass: dict[tuple[str, str], float] = {}  # monotonic time of the last pass
        self._applied: apply.AppliedMemo = {}  # children as last written (see apply.py)
        self.passes = 0  # number of reconcile passes run (for tests and benchmarks)

    async def reconcile(self, body: Mapping[str, Any], full: bool = False) -> None:
        """Converge the pool's children and status. Re-reads the pool when coalescing.
        `full` also looks for orphaned children even if the spec did not change."""
        meta = body["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        if full:
            self._pruned.pop(key, None)
        slot = self._slots.setdefault(key, _Slot(asyncio.Lock()))
        if slot.lock.locked():
            slot.pending = True  # the running pass re-reads the pool and goes again
            return
        async with slot.lock:
            current: Mapping[str, Any] | None = body
            slot.pending = False
            while current is not None:
                if self._gate is None:
                    self._gate = asyncio.Semaphore(self.max_concurrent)
                async with self._gate:
                    await self._pass(current)
                if not slot.pending:
                    break
                # Reset *before* re-reading: a trigger that lands during the read sets
                # it again, so the pass after this one starts from a fresh read.
                slot.pending = False
                current = await self._reread(key)
        if not slot.lock.locked() and not slot.pending:
            self._slots.pop(key, None)

    def idle_for(self, namespace: str, name: str) -> float:
        """Seconds since the pool's last pass (inf if never): the resync skips pools
        that event-driven passes keep fresh, so its load does not delay drift repair."""
        last = self._last_pass.get((namespace, name))
        return float("inf") if last is None else time.monotonic() - last

    async def reconcile_named(self, namespace: str, name: str) -> None:
        """Reconcile by name (child events): no read at all if a pass is already running
        for the pool — it is marked pending and the running pass re-reads it."""
        slot = self._slots.get((namespace, name))
        if slot is not None and slot.lock.locked():
            slot.pending = True
            return
        body = await self._reread((namespace, name))
        if body is not None:
            await self.reconcile(body)

    async def _reread(self, key: tuple[str, str]) -> Mapping[str, Any] | None:
        try:
            return await self.client.get(kube.POOLS, key[0], key[1])
        except kube.NotFound:
            return None

    async def _pass(self, body: Mapping[str, Any]) -> None:
        self.passes += 1
        meta = body["metadata"]
        self._last_pass[(meta.get("namespace") or "default", meta["name"])] = time.monotonic()
        if meta.get("deletionTimestamp"):
            self._pruned.pop((meta.get("namespace") or "default", meta["name"]), None)
            self._last_pass.pop((meta.get("namespace") or "default", meta["name"]), None)
            for key in [k for k in self._applied if k[1] == meta.get("namespace")
                        and (k[2] == meta["name"] or k[2].startswith(meta["name"] + "-"))]:
                del self._applied[key]
            return  # owner references and the finalizer take it from here
        previous = body.get("status") or {}
        try:
            pool = PoolSpec.from_body(body)
        except SpecError as e:
            status = invalid_spec_status(int(body["metadata"].get("generation") or 0),
                                         str(e), previous, self.clock())
            if not same_status(previous, status):
                self.events(body, "Warning", "InvalidSpec", str(e))
                await self._write_status(body, status)
            return
        key, version = (pool.namespace, pool.name), (pool.uid, pool.generation)
        prune = self._pruned.get(key) != version
        gie = self.gie if self.gie is not None and self.gie.applies_to(pool.namespace) else None
        epp, epp_problem = await self._epp(pool, gie) if gie is not None else ([], None)
        report = await apply.apply_all(self.client, render_pool(pool, self.config) + epp,
                                       pool.uid, prune_orphans=prune, memo=self._applied)
        if prune:
            self._pruned[key] = version
        if epp_problem is not None:
            report.problems.append(epp_problem)
        if gie is not None:
            await self._apply_gie(pool, gie, report, render_epp.epp_name(pool.name)
                                  if epp else None)
        for name in report.created:
            self.events(body, "Normal", "Created", f"created {name}")
        for name in report.updated:
            self.events(body, "Normal", "Updated", f"updated {name} to the desired spec")
        for name in report.deleted:
            self.events(body, "Normal", "Deleted", f"deleted {name} (no longer desired)")
        observed = await observe(self.client, pool, report.live)
        loras = await self.loras.sync(pool, observed.pods) if self.loras else None
        problems = report.problems + observed.problems + (loras.problems if loras else [])
        if loras is not None:
            for verb, counts in (("loaded", loras.loaded), ("unloaded", loras.unloaded)):
                for name, n in sorted(counts.items()):
                    self.events(body, "Normal", f"Lora{verb.capitalize()}",
                                f"{verb} adapter {name} on {n} engine{'s' * (n != 1)}")
        status = compute_status(pool, observed, problems, previous, self.clock(),
                                loras.status if loras is not None else None)
        if not same_status(previous, status):
            old = {c["type"]: c for c in previous.get("conditions") or ()}
            new = status["conditions"][2]
            if new["status"] == "True" and old.get("Degraded", {}).get("reason") != new["reason"]:
                self.events(body, "Warning", new["reason"], new["message"])
            gone = set(previous.get("roles") or {}) - set(status["roles"])
            patch = {**status, "roles": {**{r: None for r in gone}, **status["roles"]}}
            if "loras" in previous and "loras" not in status:  # LoRA switched off
                patch["loras"] = None
            await self._write_status(body, patch)

    async def _epp(self, pool: PoolSpec, gie: GieConfig
                   ) -> tuple[list[dict[str, Any]], tuple[str, str] | None]:
        """The pool's own picker (render_epp) from the template Deployment; none without a
        template, or (with a problem that degrades the pool) when it cannot be read."""
        if gie.picker_template is None:
            return [], None
        try:
            template = await self.client.get(kube.DEPLOYMENTS, pool.namespace,
                                             gie.picker_template)
            return render_epp.render_epp(pool, template), None
        except (kube.ApiError, ValueError) as e:
            if isinstance(e, kube.ApiError) and kube.is_transient(e):
                raise
            message = (f"the pool's endpoint picker is not made from Deployment "
                       f"{pool.namespace}/{gie.picker_template} ({e}); its GIE pool names "
                       f"{gie.picker_service} meanwhile")
            return [], ("EndpointPickerTemplateMissing", message)

    async def _apply_gie(self, pool: PoolSpec, gie: GieConfig, report: apply.ApplyReport,
                         picker: str | None = None) -> None:
        """The pool's GIE InferencePool (naming `picker`, else the shared picker Service),
        applied like the other children. A failure (GIE's CRD not installed, RBAC, the name
        taken) degrades the pool; it does not stop the pass."""
        ref = render_gie.GIE_POOLS
        name = f"{render_gie.KIND}.{ref.group}/{pool.name}"  # not our own InferencePool
        try:
            action, _ = await apply.apply_child(
                self.client, render_gie.render_gie_pool(pool, gie, picker), pool.uid,
                self._applied)
        except apply.NotOwned as e:
            report.problems.append(("ChildNotOwned", str(e)))
        except kube.ApiError as e:
            message = f"{name} not applied ({e}); GIE mode needs the {ref.plural}.{ref.group} CRD"
            report.problems.append(("GIEPoolFailed", message))
        else:
            getattr(report, action).append(name)

    async def _write_status(self, body: Mapping[str, Any], status: dict[str, Any]) -> None:
        meta = body["metadata"]
        try:
            await self.client.patch(kube.POOLS, meta.get("namespace"), meta["name"],
                                    {"status": status}, subresource="status")
        except kube.NotFound:
            log.info("pool %s/%s vanished before its status was written",
                     meta.get("namespace"), meta["name"])
