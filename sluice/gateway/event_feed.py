"""Subscribe to every engine's KV events and keep the prefix index current.

One thread owns all ZMQ sockets (they are not thread-safe). Per pod: a SUB
socket on its event endpoint (all topics) and, if it has one, a DEALER on its
replay endpoint. Catch-up protocol (vLLM's): send the 8-byte big-endian start
seq, read `(seq, payload)` until seq == -1.

- Pod added: connect SUB first (so nothing is lost), then, if Redis holds the
  pod's last applied seq, warm the local view from Redis and replay from
  seq + 1 (a restarted gateway catches up); otherwise replay from 0.
- Gap in live seqs: replay the missing range.
- seq back at 0 with a newer timestamp: the engine restarted; its old entries
  are dropped before applying.
- Between batches: `PrefixIndex.recover()` when Redis had been unreachable.
Commands (add/remove pod) arrive through a bounded queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from sluice.gateway.prefix_index import PrefixIndex
from sluice.gateway.translate import translate
from sluice.kv_events import decode_batch

log = logging.getLogger("sluice.gateway.events")


@dataclass(frozen=True)
class EventSource:
    pod: str                     # host:port of the engine's HTTP server
    model: str                   # served model name (seeds the request keys)
    endpoint: str                # e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None  # e.g. tcp://10.0.0.5:5558


@dataclass
class _PodState:
    source: EventSource
    sub: zmq.Socket
    replay: zmq.Socket | None
    last_seq: int = -1
    last_ts: float = 0.0


class EventFeeder:
    def __init__(self, index: PrefixIndex, replay_timeout_s: float = 2.0,
                 max_replay_batches: int = 100_000, recover_every_s: float = 0.5) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.max_replay_batches = max_replay_batches
        self.recover_every_s = recover_every_s
        self._ctx = zmq.Context.instance()
        self._cmds: queue.Queue = queue.Queue(maxsize=10_000)
        self._pods: dict[str, _PodState] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-feeder", daemon=True)
        self.batches = 0
        self.blocks = 0
        self.orphans = 0
        self.restarts = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def add(self, source: EventSource) -> None:
        self._cmds.put(("add", source))

    def remove(self, pod: str) -> None:
        self._cmds.put(("remove", pod))

    def pods(self) -> list[str]:
        return list(self._pods)

    # -- thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        next_recover = 0.0
        while not self._stop.is_set():
            self._drain_commands(poller)
            now = time.monotonic()
            if self.index.mode == "local" and now >= next_recover:
                next_recover = now + self.recover_every_s
                self.index.recover()
            if not self._pods:  # zmq_poll on no sockets returns at once: don't spin
                self._stop.wait(0.05)
                continue
            ready = dict(poller.poll(50))
            for state in list(self._pods.values()):
                if state.sub in ready:
                    for _ in range(1000):  # bounded drain per pod per round
                        try:
                            frames = state.sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(state, frames)
        for state in self._pods.values():
            self._close(state)

    def _drain_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                cmd, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd == "add" and arg.pod not in self._pods:
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.setsockopt(zmq.RCVHWM, 100_000)
                sub.connect(arg.endpoint)
                replay = None
                if arg.replay_endpoint:
                    replay = self._ctx.socket(zmq.DEALER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.connect(arg.replay_endpoint)
                state = self._pods[arg.pod] = _PodState(arg, sub, replay)
                poller.register(sub, zmq.POLLIN)
                self._catch_up_new(state)
            elif cmd == "remove" and arg in self._pods:
                state = self._pods.pop(arg)
                poller.unregister(state.sub)
                self._close(state)
                self.index.forget_pod(arg)

    def _close(self, state: _PodState) -> None:
        state.sub.close(linger=0)
        if state.replay is not None:
            state.replay.close(linger=0)

    def _catch_up_new(self, state: _PodState) -> None:
        stored = self.index.stored_seq(state.source.pod)
        if stored is not None:
            self.index.warm_from_redis(state.source.pod)
            state.last_seq = stored
        self._replay(state, state.last_seq + 1)

    def _replay(self, state: _PodState, start: int) -> None:
        if state.replay is None:
            return
        state.replay.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + self.replay_timeout_s
        for _ in range(self.max_replay_batches + 1):
            left = deadline - time.monotonic()
            if left <= 0 or not state.replay.poll(int(left * 1000)):
                log.warning("replay from %s timed out", state.source.pod)
                return
            frames = state.replay.recv_multipart()
            frames = frames[1:] if frames and frames[0] == b"" else frames
            seq_bytes, payload = frames[-2], frames[-1]  # tolerate (topic, seq, payload)
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                return
            if seq > state.last_seq:
                if state.last_seq >= 0 and seq > state.last_seq + 1:
                    log.warning("%s: events %d..%d are no longer in the engine's replay "
                                "buffer", state.source.pod, state.last_seq + 1, seq - 1)
                self._apply(state, seq, payload)

    def _on_live(self, state: _PodState, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big")
        if seq <= state.last_seq:
            if seq == 0 and state.last_seq > 0:
                try:
                    ts = decode_batch(frames[2]).ts
                except (msgspec.DecodeError, ValueError, TypeError):
                    return
                if ts > state.last_ts:  # the engine restarted: its cache is empty
                    log.warning("%s restarted (seq back to 0): dropping its entries",
                                state.source.pod)
                    self.restarts += 1
                    self.index.forget_pod(state.source.pod)
                    state.last_seq = -1
                    self._apply(state, seq, frames[2])
            return
        if state.last_seq >= 0 and seq > state.last_seq + 1:
            self._replay(state, state.last_seq + 1)
            if seq <= state.last_seq:
                return
        self._apply(state, seq, frames[2])

    def _apply(self, state: _PodState, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as err:
            log.warning("%s: undecodable event batch %d: %s", state.source.pod, seq, err)
            state.last_seq = seq
            return
        pod = state.source.pod
        t = translate(batch, state.source.model, lambda f: self.index.local.key_of(pod, f))
        self.index.apply(pod, seq, t.stored, t.removed, t.cleared, t.block_size)
        state.last_seq, state.last_ts = seq, batch.ts
        self.batches += 1
        self.blocks += len(t.stored) + len(t.removed)
        self.orphans += t.orphans
