"""Runs the LLMEngine on a background thread beside an asyncio event loop, in-process.

`sluice engine` runs the engine in its own process instead (sluice.engine.core), with
the same interface; this in-process form serves tests, benchmarks and embedding.

The engine thread owns the LLMEngine: it drains a queue of commands (add,
abort), runs one step whenever there is work, and hands each RequestOutput to
the request's asyncio queue with `call_soon_threadsafe`. Torch releases the
GIL inside its kernels, so the HTTP server stays responsive while a step runs.
The waiting queue is bounded: `generate` raises EngineOverloadedError when
`max_waiting_requests` requests are already queued.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from sluice.engine.core.messages import EngineInfo
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams

log = logging.getLogger("sluice.engine")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread crashed; the process cannot serve (HTTP 503)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after each step (KV events)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._num_pending = 0  # added but not yet finished or aborted
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        cfg = engine.config
        self.info = EngineInfo(cfg.model, cfg.served_model_name, engine.max_model_len,
                               engine.model.config.vocab_size,
                               cfg.scheduler.max_waiting_requests,
                               cfg.kv_transfer.kv_role if cfg.kv_transfer else None,
                               engine.kv.block_size, cfg.scheduler.policy,
                               cfg.lora.max_loras if cfg.lora else 0, engine.lora_modules())
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, cache_salt: str | None = None,
                       priority: int = 0, lora_name: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request.

        Validation errors (ValueError) and overload (EngineOverloadedError) are
        raised before the first output.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self.waiting_room() <= 0:
            limit = self.engine.config.scheduler.max_waiting_requests
            raise EngineOverloadedError(f"the waiting queue is full (limit {limit})")
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        done = loop.create_future()
        with self._lock:
            self._streams[request_id] = (loop, out_q)
            self._num_pending += 1
        self._commands.put(("add", request_id, prompt_token_ids, params, cache_salt, priority,
                            lora_name, done))
        self._wake.set()
        finished = False
        try:
            await done  # raises the engine's validation error, if any
            while True:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def waiting_room(self) -> int:
        """How many more requests the waiting queue takes now (max_waiting_requests - waiting).

        Read on the event loop while the engine thread runs: exact for requests this
        loop adds (counted at once), at most a step stale for those the scheduler admits.
        """
        limit = self.engine.config.scheduler.max_waiting_requests
        waiting_now = self._num_pending - len(self.engine.scheduler.running)
        return max(0, limit - waiting_now)

    def metrics_text(self) -> bytes:
        """The engine's Prometheus exposition."""
        from prometheus_client import generate_latest

        return generate_latest(self.engine.metrics.registry)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (AllBlocksCleared); False while requests hold blocks."""
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("reset", done))
        self._wake.set()
        return await done

    async def load_lora_adapter(self, name: str, path: str) -> str | None:
        """Register an adapter (read off the engine thread); why it cannot be, or None."""
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("load", name, path, done))
        self._wake.set()
        return await done

    async def unload_lora_adapter(self, name: str) -> bool:
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("unload", name, done))
        self._wake.set()
        return await done

    def lora_modules(self) -> dict[str, str]:
        return self.engine.lora_modules()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands()
                for done, error in self.engine.finished_lora_loads():
                    done.get_loop().call_soon_threadsafe(_set_result, done, error)
                if not self.engine.has_unfinished():
                    lora = self.engine.lora
                    self._wake.wait(timeout=0.02 if lora and lora.pending() else 1.0)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out)
                if self.on_step is not None:
                    self.on_step()
        except BaseException as exc:
            log.exception("engine loop crashed")
            self.error = exc
            with self._lock:
                streams = list(self._streams.values())
            for loop, out_q in streams:
                loop.call_soon_threadsafe(out_q.put_nowait, EngineDeadError(repr(exc)))

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, salt, priority, lora_name, done = cmd
                loop = done.get_loop()
                try:
                    self.engine.add_request(rid, prompt, params, salt, priority=priority,
                                            lora_name=lora_name)
                except ValueError as exc:
                    self._finish_pending()
                    loop.call_soon_threadsafe(_set_exception, done, exc)
                else:
                    loop.call_soon_threadsafe(_set_result, done)
            elif cmd[0] == "reset":
                done = cmd[1]
                cleared = self.engine.kv.reset_prefix_cache()
                if self.on_step is not None:
                    self.on_step()  # publish AllBlocksCleared now, not after the next step
                done.get_loop().call_soon_threadsafe(_set_result, done, cleared)
            elif cmd[0] == "load":
                _, name, path, done = cmd
                try:
                    self.engine.start_lora_load(done, name, path)
                except ValueError as exc:
                    done.get_loop().call_soon_threadsafe(_set_result, done, str(exc))
            elif cmd[0] == "unload":
                done = cmd[2]
                removed = self.engine.unload_lora(cmd[1])
                done.get_loop().call_soon_threadsafe(_set_result, done, removed)
            else:
                if self.engine.abort_request(cmd[1]) is not None:
                    self._finish_pending()

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            self._finish_pending()
        with self._lock:
            target = self._streams.get(out.request_id)
        if target is not None:
            loop, out_q = target
            loop.call_soon_threadsafe(out_q.put_nowait, out)

    def _finish_pending(self) -> None:
        with self._lock:
            self._num_pending -= 1
            assert self._num_pending >= 0


def _set_result(fut: asyncio.Future, value: object = None) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
