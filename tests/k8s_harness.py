"""Test harness: the real operator (kopf + Reconciler + Autoscaler) in its own thread and
event loop, as if in its own process, against the session's real kube-apiserver
(`kube_api.ControlPlane`), logged in with a kubeconfig: the admin's, or a ServiceAccount
token's so that RBAC is the real authorizer's."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import pathlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import kopf
from kube_api import ControlPlane

from sluice.operator import credentials, kube
from sluice.operator.config import OperatorConfig
from sluice.operator.runtime import build_runtime, run


@contextlib.asynccontextmanager
async def client(kubeconfig: pathlib.Path) -> AsyncIterator[kube.KubeClient]:
    """The operator's own client, as whoever `kubeconfig` names (the test's side: it
    creates pools and reads what the operator did). Its field manager is the test's."""
    api = kube.KubeClient.from_configuration(await credentials.load(kubeconfig),
                                             field_manager="sluice-test")
    try:
        yield api
    finally:
        await api.close()


async def _no_load(endpoints: list[dict[str, Any]], role: str) -> None:
    return None


class FakePurger:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str]]] = []

    async def __call__(self, namespace: str, pool: str, pods: list[str]) -> int:
        self.calls.append((namespace, pool, pods))
        return len(pods)


def quick_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.queueing.idle_timeout = 0.5
    settings.queueing.exit_timeout = 0.5
    settings.background.instant_exit_timeout = 0.05
    return settings


def peering_settings() -> kopf.OperatorSettings:
    """`quick_settings` for replicas that peer. A silent peer counts as alive for the
    lifetime; kopf refreshes its entry about every lifetime - 5..10 s (at least 1 s), so
    a short lifetime would let one slow second on a loaded machine make the standby think
    the active one died."""
    settings = quick_settings()
    settings.peering.lifetime = 10
    return settings


@contextlib.asynccontextmanager
async def operator(plane: ControlPlane, *, kubeconfig: pathlib.Path | None = None,
                   sampler: Callable[..., Awaitable[Any]] = _no_load, purge: Any = None,
                   index: bool = True, settings: kopf.OperatorSettings | None = None,
                   transport: Any = None, **config: Any) -> AsyncIterator[Any]:
    """Run the operator in its own thread and event loop until the block exits; yields its
    Runtime. `kubeconfig`: whom it logs in as (default: the admin). `index=False`: no
    index to clean (no Redis URL, no purger), so no finalizer. `transport`: how it reaches
    the engines (an httpx transport)."""
    cfg = OperatorConfig(**{"standalone": True, "liveness_endpoint": None,
                            "resync_interval_s": 30.0, "autoscale_interval_s": 30.0, **config})
    stop, ready = threading.Event(), threading.Event()
    settings = settings or quick_settings()
    errors: list[BaseException] = []
    runtime: list[Any] = []
    purger = (purge or FakePurger()) if index else None

    async def operate() -> None:
        # The clients are made in this loop: their aiohttp sessions belong to it.
        configuration = await credentials.load(kubeconfig or plane.admin_kubeconfig)
        rt = build_runtime(cfg, configuration, purge=purger, sampler=sampler,
                           transport=transport)
        runtime.append(rt)
        # Stopping by cancellation (like SIGTERM) rather than kopf's stop flag: the flag
        # makes kopf wait 5 s for its sleeping timer tasks on every test.
        task = asyncio.create_task(run(cfg, configuration, runtime=rt, ready_flag=ready,
                                       settings=settings))
        await asyncio.to_thread(stop.wait)
        rt.stats["operator_thread_cpu_s"] = time.thread_time()  # read by the benchmark
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def main() -> None:
        try:
            asyncio.run(operate())
        except BaseException as e:  # noqa: BLE001 (re-raised in the test thread below)
            errors.append(e)
            ready.set()

    thread = threading.Thread(target=main, name="operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 15), "operator did not start"
    assert not errors, errors
    try:
        yield runtime[0]
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "operator did not stop"
        assert not errors, errors


async def eventually(check: Callable[[], Any], timeout: float = 5.0, what: str = "") -> Any:
    """Poll `check()` (sync, or returning an awaitable) until it gives a truthy value, or
    raise with `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if inspect.isawaitable(last):
                last = await last
            if last:
                return last
        except (KeyError, AssertionError, LookupError, kube.ApiError) as e:
            last = e
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what} (last: {last!r})")


class View:
    """What the tests read back: one namespace's objects, through a client."""

    def __init__(self, api: kube.KubeClient, namespace: str, pool: str = "smollm2"):
        self.api, self.ns, self.name = api, namespace, pool

    async def get(self, ref: kube.ResourceRef, name: str) -> dict[str, Any]:
        return await self.api.get(ref, self.ns, name)

    async def names(self, ref: kube.ResourceRef) -> list[str]:
        return sorted(o["metadata"]["name"] for o in await self.api.list(ref, self.ns))

    async def pool(self) -> dict[str, Any]:
        return await self.api.get(kube.POOLS, self.ns, self.name)

    async def condition(self, type_: str) -> dict[str, Any] | None:
        conditions = ((await self.pool()).get("status") or {}).get("conditions", ())
        return next((c for c in conditions if c["type"] == type_), None)

    async def events(self) -> list[tuple[str, str]]:
        return [(e["reason"], e.get("message", ""))
                for e in await self.api.list(kube.EVENTS, self.ns)]

    async def ready(self, n: int) -> bool:
        """The pool reports `n` ready engines for its current generation, and Ready."""
        pool = await self.pool()
        status = pool.get("status") or {}
        ready = next((c for c in status.get("conditions", ()) if c["type"] == "Ready"), {})
        return (status.get("readyReplicas") == n
                and status.get("observedGeneration") == pool["metadata"]["generation"]
                and ready.get("status") == "True")

    async def container_arg(self, deployment: str, flag: str) -> str:
        container = (await self.get(kube.DEPLOYMENTS, deployment))["spec"]["template"][
            "spec"]["containers"][0]
        return container["args"][container["args"].index(flag) + 1]
