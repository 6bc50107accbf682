"""Test harness: an emulated API server with the InferencePool CRD, and the real
operator (kopf + Reconciler + Autoscaler) running against it in the same event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import k8s_schema
import kmock
import kopf
from k8s_store import ApiError
from kube_emulator import ApiServerEmulator

from sluice.operator import crd
from sluice.operator.config import OperatorConfig
from sluice.operator.runtime import build_runtime, run

SCHEMA = k8s_schema.crd_schema(crd.render_crd())


def pool_validator(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    return k8s_schema.validate(SCHEMA, obj)


@contextlib.asynccontextmanager
async def cluster():
    """(api, server): the emulator with the CRD registered (and validated like the API server)."""
    async with ApiServerEmulator() as api, kmock.Server(api) as server:
        api.register_crd(crd.render_crd(), validator=pool_validator)
        yield api, server


def connection(server: kmock.Server) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=str(server.url).rstrip("/"))


async def _no_load(endpoints: list[dict[str, Any]], role: str) -> None:
    return None


class FakePurger:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str]]] = []

    async def __call__(self, namespace: str, pool: str, pods: list[str]) -> int:
        self.calls.append((namespace, pool, pods))
        return len(pods)


@contextlib.asynccontextmanager
async def operator(server: kmock.Server, *, sampler: Callable[..., Awaitable[Any]] = _no_load,
                   purge: Any = None, index: bool = True,
                   settings: kopf.OperatorSettings | None = None, login: Any = None,
                   **config: Any):
    """Run the operator in its own thread and event loop (as if in its own process) until
    the block exits; yields its Runtime. `index=False`: no index to clean (no Redis URL, no
    purger), so no finalizer. `login`: a `credentials.Login` instead of the plain connection."""
    cfg = OperatorConfig(**{"standalone": True, "liveness_endpoint": None,
                            "resync_interval_s": 30.0, "autoscale_interval_s": 30.0, **config})
    conn = login or connection(server)
    rt = build_runtime(cfg, conn, purge=(purge or FakePurger()) if index else None,
                       sampler=sampler)
    stop, ready = threading.Event(), threading.Event()
    if settings is None:
        settings = kopf.OperatorSettings()
        settings.queueing.idle_timeout = 0.5
        settings.queueing.exit_timeout = 0.5
        settings.background.instant_exit_timeout = 0.05
    errors: list[BaseException] = []

    async def operate() -> None:
        # Stopping by cancellation (like SIGTERM) rather than kopf's stop flag: the flag
        # makes kopf wait 5 s for its sleeping timer tasks on every test.
        task = asyncio.create_task(run(cfg, conn, runtime=rt, ready_flag=ready,
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
    assert await asyncio.to_thread(ready.wait, 10), "operator did not start"
    try:
        yield rt
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "operator did not stop"
        assert not errors, errors


async def eventually(check: Callable[[], Any], timeout: float = 5.0, what: str = "") -> Any:
    """Poll `check()` (sync) until it returns a truthy value or raise with `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (KeyError, AssertionError, LookupError, ApiError) as e:
            last = e
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout}s: {what} (last: {last!r})")
