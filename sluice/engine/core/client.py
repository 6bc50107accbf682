"""The API process's half of the engine core: starts the core process, sends it requests,
and routes each step's outputs to the asyncio streams waiting for them.

It has AsyncEngine's interface (`generate`, `abort`, `waiting_room`, `reset_prefix_cache`,
`metrics_text`, `info`, `error`, `shutdown`), so the HTTP layer serves either.

Threads: the event loop sends commands (under `_send_lock`: ZMQ sockets are not
thread-safe); one reader thread owns the event socket, decodes each message and hands a
step's outputs to their streams' loops in one `call_soon_threadsafe` per loop. The
stream table is shared by both and guarded by `_lock`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import zmq

from sluice.engine.async_engine import EngineDeadError, EngineOverloadedError
from sluice.engine.core.messages import (
    Abort,
    Added,
    AddRequest,
    Dead,
    LoadLoRA,
    Metrics,
    Outputs,
    Ready,
    Reply,
    ResetPrefixCache,
    Shutdown,
    UnloadLoRA,
    encoder,
    event_decoder,
)
from sluice.engine.core.process import CoreSpec, run_engine_core
from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams

log = logging.getLogger("sluice.engine")


class EngineCoreClient:
    def __init__(self, spec: CoreSpec, on_dead: Callable[[], None] | None = None):
        """Start the core with `spec` (its addresses are chosen here) and wait until its
        model is loaded; raises RuntimeError if the core dies while starting."""
        self._dir = tempfile.mkdtemp(prefix="sluice-core-")  # 0700: the sockets stay ours
        spec = replace(spec, input_address=f"ipc://{self._dir}/input",
                       output_address=f"ipc://{self._dir}/output")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # bounded by the waiting room instead
        self._input.bind(spec.input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(spec.output_address)
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(spec,), name="EngineCore", daemon=True)
        self._proc.start()
        self.on_dead = on_dead
        self.error: BaseException | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue,
                                       asyncio.Future]] = {}
        self._live: set[str] = set()  # added, not yet finished, failed or aborted
        self._num_running = 0
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._metrics = b""
        self._stopping = False
        try:
            self.info = self._wait_ready()
            self._loras = dict(self.info.loras)
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read, name="engine-core-reader",
                                        daemon=True)
        self._reader.start()

    # -- the AsyncEngine interface ----------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, cache_salt: str | None = None,
                       priority: int = 0, lora_name: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request.
        Validation errors (ValueError) and overload are raised before the first output."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self.waiting_room() <= 0:
            raise EngineOverloadedError(
                f"the waiting queue is full (limit {self.info.max_waiting_requests})")
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (loop, out_q, added)
            self._live.add(request_id)
        self._send(AddRequest(request_id, list(prompt_token_ids), params, cache_salt,
                              time.time(), priority, lora_name))
        finished = False
        try:
            await added  # the core's validation error, if any
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
                live = request_id in self._live
                self._live.discard(request_id)
            if live and not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
        if self.error is None:
            self._send(Abort([request_id]))

    def waiting_room(self) -> int:
        """max_waiting_requests minus the requests added and not yet running (the running
        count is the core's as of its last step)."""
        with self._lock:
            waiting = max(0, len(self._live) - self._num_running)  # the count may predate aborts
        return max(0, self.info.max_waiting_requests - waiting)

    async def reset_prefix_cache(self) -> bool:
        return (await self._call(ResetPrefixCache)).value

    async def load_lora_adapter(self, name: str, path: str) -> str | None:
        """Register an adapter; the reason it cannot be served, or None."""
        reply = await self._call(lambda call_id: LoadLoRA(call_id, name, path))
        if reply.value:
            self._loras[name] = path
        return reply.error

    async def unload_lora_adapter(self, name: str) -> bool:
        """Unregister an adapter (its running requests finish); False if unknown."""
        self._loras.pop(name, None)
        return (await self._call(lambda call_id: UnloadLoRA(call_id, name))).value

    def lora_modules(self) -> dict[str, str]:
        """The registered adapters, name -> path (as of this process's last load/unload)."""
        return self._loras

    async def _call(self, make: Callable[[int], object]) -> Reply:
        """Send make(call_id) and wait for the core's Reply to it."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = (loop, done)
        self._send(make(call_id))
        return await done

    def metrics_text(self) -> bytes:
        """The core's latest Prometheus exposition (at most METRICS_INTERVAL_S plus a step old)."""
        return self._metrics

    def shutdown(self) -> None:
        self._stopping = True
        if self._proc.is_alive():
            try:
                self._send(Shutdown())
            except zmq.ZMQError:
                pass
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- internals --------------------------------------------------------------------------
    def _send(self, msg) -> None:
        data = encoder.encode(msg)
        with self._send_lock:
            self._input.send(data)

    def _wait_ready(self):
        while True:
            if self._output.poll(500):
                event = event_decoder.decode(self._output.recv())
                if isinstance(event, Ready):
                    return event.info
                if isinstance(event, Dead):
                    raise RuntimeError(f"the engine core failed to start: {event.reason}")
                if isinstance(event, Metrics):
                    self._metrics = event.text
            elif not self._proc.is_alive():
                raise RuntimeError(
                    f"the engine core exited with code {self._proc.exitcode} while starting")

    def _read(self) -> None:
        while not self._stopping:
            if not self._output.poll(500):
                if not self._proc.is_alive():
                    self._die(f"the engine core exited with code {self._proc.exitcode}")
                    return
                continue
            event = event_decoder.decode(self._output.recv())
            if isinstance(event, Outputs):
                self._deliver(event)
            elif isinstance(event, Added):
                self._added(event)
            elif isinstance(event, Metrics):
                self._metrics = event.text
            elif isinstance(event, Reply):
                with self._lock:
                    loop, fut = self._calls.pop(event.call_id)
                loop.call_soon_threadsafe(_set_result, fut, event)
            elif isinstance(event, Dead):
                self._die(f"the engine core crashed: {event.reason}")
                return

    def _deliver(self, event: Outputs) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        if event.metrics is not None:
            self._metrics = event.metrics
        with self._lock:
            self._num_running = event.num_running
            for out in event.outputs:
                target = self._streams.get(out.request_id)
                if out.finished:
                    self._live.discard(out.request_id)
                if target is not None:
                    batches[target[0]].append((target[1], out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _added(self, event: Added) -> None:
        from sluice.engine.llm_engine import PromptTooLongError, UnknownModelError

        with self._lock:
            target = self._streams.get(event.request_id)
            if event.error is not None:
                self._live.discard(event.request_id)
        if target is None:
            return
        loop, _, added = target
        if event.error is None:
            loop.call_soon_threadsafe(_set_result, added, None)
        else:
            kind = (PromptTooLongError if event.prompt_too_long else
                    UnknownModelError if event.unknown_model else ValueError)
            error = kind(event.error)
            loop.call_soon_threadsafe(_set_exception, added, error)

    def _die(self, reason: str) -> None:
        if self._stopping:
            return
        log.error("%s", reason)
        self.error = EngineDeadError(reason)
        with self._lock:
            streams = list(self._streams.values())
            calls = list(self._calls.values())
            self._calls.clear()
        for loop, out_q, added in streams:
            loop.call_soon_threadsafe(_set_exception, added, self.error)
            loop.call_soon_threadsafe(out_q.put_nowait, self.error)
        for loop, fut in calls:
            loop.call_soon_threadsafe(_set_exception, fut, self.error)
        if self.on_dead is not None:
            self.on_dead()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for out_q, out in items:
        out_q.put_nowait(out)


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
