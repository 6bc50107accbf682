"""The engine core process: scheduler and model in one loop, fed and drained over ZMQ.

The loop, each turn:
  1. take every queued command (add, abort, reset) without blocking when requests are
     unfinished, else block up to the next metrics push;
  2. if any request is unfinished, run one engine step and send all its outputs in one
     message, with the running count the API process sizes its waiting room from;
  3. push the Prometheus exposition when something changed and METRICS_INTERVAL_S has
     passed since the last push, or with the outputs of a step that finished a request
     or changed the running or waiting count (gauges a client reads right after its
     answer, or a gateway balances on), so a scrape in the API process never waits for a step (a prefill step takes seconds
     on CPU; gateways scrape with a 0.5 s timeout). Rendering it costs ~1.5 ms.
KV events are published from this process, right after the step that made them.
The process ends on Shutdown, when its parent dies (PR_SET_PDEATHSIG), or on a crash,
which it reports as Dead before exiting.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections.abc import MutableMapping
from dataclasses import dataclass

import zmq

from sluice.engine.config import EngineConfig
from sluice.engine.core.messages import (
    Abort,
    Added,
    AddRequest,
    Dead,
    EngineInfo,
    LoadLoRA,
    Metrics,
    Outputs,
    Ready,
    Reply,
    ResetPrefixCache,
    Shutdown,
    UnloadLoRA,
    command_decoder,
    encoder,
)

log = logging.getLogger("sluice.engine.core")

METRICS_INTERVAL_S = 0.1
KV_HOLD_POLL_MS = 20
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class KVEventsSpec:
    endpoint: str
    replay_endpoint: str | None
    topic: str
    curve_dir: str | None


@dataclass(frozen=True)
class CoreSpec:
    """Everything the core process is started with (pickled once by multiprocessing)."""

    config: EngineConfig
    tokenizer_path: str | None
    num_threads: int
    kv_events: KVEventsSpec | None
    input_address: str  # the API process binds both; the core connects
    output_address: str
    log_level: str = "INFO"


def native_library_defaults(env: MutableMapping[str, str]) -> None:
    """Set in `env` (the process's, before torch loads) what OpenMP and oneDNN read at load
    time, leaving every variable the user set alone."""
    # OpenMP: how long a thread spins at a barrier before it sleeps. A step runs ~150
    # parallel regions with Python between them, and waking a sleeping thread for each cost
    # more than the second thread gained (2 threads, batch 8: 23.4 ms sleeping, 15.6 ms
    # spinning, 21.4 ms on one thread). 3M spins are ~70 ms here: they span
    # the gaps between steps while serving, and an idle engine stops spinning soon after.
    # Serving at concurrency 8/32, 2 threads: 242/443 tok/s sleeping, 329/552 spinning
    # (docs/benchmarks.md). libgomp cuts the spin when threads outnumber usable CPUs.
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", "3000000")
    # Compiled oneDNN primitives are cached per shape, and a step with a new token count
    # adds one per linear (qkv, o, gate_up, down, lm_head). ideep's cache behind the packed
    # linears (LRU_CACHE_CAPACITY, default 1,024) held ~300 MiB once full and fragmented the
    # heap: a core's RSS grew 3.07 -> 3.42 GiB over 600 requests arriving one by one; at 32
    # it stayed at 3.07 GiB. A miss re-creates a primitive in 5-60 us, against a 15-60 ms
    # step, and a decode step reuses the last step's shapes (docs/benchmarks.md, soak).
    # oneDNN's own cache (default 1,024) serves the unpacked ops: at 256 a tiny-model
    # engine's RSS levelled at +66 MiB rather than +170 MiB and rising.
    env.setdefault("LRU_CACHE_CAPACITY", "32")
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")


def run_engine_core(spec: CoreSpec) -> None:
    """Entry point of the core process."""
    die_with_parent()
    native_library_defaults(os.environ)
    logging.basicConfig(level=spec.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(spec.output_address)
    inp = ctx.socket(zmq.PULL)
    inp.connect(spec.input_address)
    core = None
    try:
        core = EngineCore(spec)
        out.send(encoder.encode(Ready(core.info)))
        core.run(inp, out)
    except BaseException as exc:  # reported to the API process, which fails its streams
        if not isinstance(exc, KeyboardInterrupt):
            log.exception("engine core crashed")
        out.send(encoder.encode(Dead(repr(exc))))
        raise SystemExit(1) from exc
    finally:
        if core is not None:
            core.close()
        inp.close(linger=0)
        out.close()
        ctx.term()


class EngineCore:
    """Owns the LLMEngine and the KV-event publisher; used only by the core's one thread."""

    def __init__(self, spec: CoreSpec):
        import torch

        from sluice.engine.llm_engine import LLMEngine
        from sluice.tokenizer import Tokenizer

        torch.set_num_threads(spec.num_threads)
        if spec.config.parallel.tensor_parallel_size > 1:  # rank 0: the first core group
            from sluice.engine.distributed.worker import pin_rank_cores

            pin_rank_cores(0, spec.num_threads)
        tokenizer = Tokenizer.from_path(spec.tokenizer_path) if spec.tokenizer_path else None
        self.publisher = _publisher(spec.kv_events) if spec.kv_events else None
        self.llm = LLMEngine(spec.config, tokenizer, record_kv_events=self.publisher is not None)
        cfg = spec.config
        self.info = EngineInfo(cfg.model, cfg.served_model_name, self.llm.max_model_len,
                               self.llm.model.config.vocab_size,
                               cfg.scheduler.max_waiting_requests,
                               cfg.kv_transfer.kv_role if cfg.kv_transfer else None,
                               self.llm.kv.block_size, cfg.scheduler.policy,
                               cfg.lora.max_loras if cfg.lora else 0, self.llm.lora_modules())
        self._changed = True
        self._last_metrics = 0.0
        self._counts = (0, 0)  # (running, waiting) as of the last metrics sent

    def run(self, inp: zmq.Socket, out: zmq.Socket) -> None:
        parent = os.getppid()
        while True:
            busy = self.llm.has_unfinished()
            if inp.poll(0 if busy else self._idle_wait_ms()):
                for cmd in _drain(inp):
                    if isinstance(cmd, Shutdown):
                        return
                    self._apply(cmd, out)
            elif not busy and os.getppid() != parent:
                return  # orphaned where PR_SET_PDEATHSIG is unavailable
            for call_id, error in self.llm.finished_lora_loads():
                out.send(encoder.encode(Reply(call_id, error is None, error)))
            if self.llm.has_unfinished():
                outputs = self.llm.step()
                self._changed = True
                if self.publisher is not None:
                    self.publisher.publish(self.llm.kv.take_events())
                sched = self.llm.scheduler
                counts = (len(sched.running), len(sched.waiting))
                metrics = None
                if counts != self._counts or any(o.finished for o in outputs):
                    metrics, self._counts = self._metrics(), counts
                out.send(encoder.encode(Outputs(outputs, counts[0], metrics)))
            if self._release_kv_holds():
                self._changed = True
            if self._changed and time.monotonic() - self._last_metrics >= METRICS_INTERVAL_S:
                out.send(encoder.encode(Metrics(self._metrics())))

    def _apply(self, cmd, out: zmq.Socket) -> None:
        from sluice.engine.llm_engine import PromptTooLongError, UnknownModelError

        self._changed = True
        if isinstance(cmd, AddRequest):
            try:
                self.llm.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                     cmd.cache_salt, cmd.arrival_time, cmd.priority,
                                     cmd.lora_name)
            except ValueError as exc:
                out.send(encoder.encode(Added(cmd.request_id, str(exc),
                                              isinstance(exc, PromptTooLongError),
                                              isinstance(exc, UnknownModelError))))
            else:
                out.send(encoder.encode(Added(cmd.request_id)))
        elif isinstance(cmd, Abort):
            for rid in cmd.request_ids:
                self.llm.abort_request(rid)
        elif isinstance(cmd, ResetPrefixCache):
            cleared = self.llm.kv.reset_prefix_cache()
            if self.publisher is not None:  # AllBlocksCleared now, not after the next step
                self.publisher.publish(self.llm.kv.take_events())
            out.send(encoder.encode(Reply(cmd.call_id, cleared)))
        elif isinstance(cmd, LoadLoRA):
            try:
                self.llm.start_lora_load(cmd.call_id, cmd.name, cmd.path)
            except ValueError as exc:
                out.send(encoder.encode(Reply(cmd.call_id, False, str(exc))))
        elif isinstance(cmd, UnloadLoRA):
            out.send(encoder.encode(Reply(cmd.call_id, self.llm.unload_lora(cmd.name))))

    def _release_kv_holds(self) -> bool:
        """Disaggregated prefill: free blocks held for a pull that came or timed out."""
        connector = self.llm.kv_connector
        if connector is None or not connector.release_finished_holds():
            return False
        sched = self.llm.scheduler  # the usage gauge, as an abort refreshes it
        self.llm.metrics.on_step(len(sched.running), len(sched.waiting), self.llm.kv.usage,
                                 0, 0, 0)
        return True

    def _idle_wait_ms(self) -> int:
        connector = self.llm.kv_connector
        if connector is not None and connector.holds_blocks():
            return KV_HOLD_POLL_MS  # a pull ends on another thread: free its blocks soon
        if self.llm.lora is not None and self.llm.lora.pending():
            return KV_HOLD_POLL_MS  # an adapter is being read on another thread
        if not self._changed:
            return 1000
        due = self._last_metrics + METRICS_INTERVAL_S - time.monotonic()
        return max(0, int(due * 1000))

    def _metrics(self) -> bytes:
        from prometheus_client import generate_latest

        self._last_metrics, self._changed = time.monotonic(), False
        return generate_latest(self.llm.metrics.registry)

    def close(self) -> None:
        if self.llm.kv_connector is not None:
            self.llm.kv_connector.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.llm.lora is not None:
            self.llm.lora.close()
        self.llm.close()


def _drain(sock: zmq.Socket):
    while True:
        try:
            msg = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        yield command_decoder.decode(msg)


def _publisher(spec: KVEventsSpec):
    from sluice.engine.kv_publisher import KVEventPublisher
    from sluice.zmq_curve import ZmqSecurity

    security = ZmqSecurity(spec.curve_dir) if spec.curve_dir else None
    return KVEventPublisher(spec.endpoint, spec.replay_endpoint, spec.topic, security=security)


def die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
