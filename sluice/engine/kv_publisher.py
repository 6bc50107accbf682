"""Publish the engine's KV-cache events exactly like vLLM's `ZmqEventPublisher`.

Wire protocol (see `sluice.kv_events`): PUB multipart
`(topic, seq uint64 big-endian, msgpack(KVEventBatch))`, seq counting from 0
per process; optional ROUTER replay socket: a client sends an 8-byte
big-endian start seq and receives `(seq, payload)` for every buffered batch
with seq >= start, then `(-1 as 8 signed bytes, b"")`.

Threading: ZMQ sockets are not thread-safe, so both sockets live on one
background thread; `publish` only enqueues (bounded queue: when the thread
falls `max_queue_size` batches behind, `publish` blocks, as vLLM's does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from sluice.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from sluice.zmq_curve import ZmqSecurity

log = logging.getLogger(__name__)

_STOP = object()


def _binds(endpoint: str) -> bool:
    """vLLM's heuristic: bind wildcard / ipc / inproc endpoints, connect the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One `KVEventBatch` per `publish` call, sequence-numbered, with a replay buffer."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, data_parallel_rank: int = 0,
                 security: ZmqSecurity | None = None) -> None:
        """`security`: CURVE on both sockets, only the pickers' key admitted (else
        plain sockets, as vLLM's: keep them private by network policy)."""
        assert buffer_steps > 0 and max_queue_size > 0
        # its own context: a ZAP handler is one per context, and a closed one's inproc
        # address is released only once the context's reaper gets to it
        self._ctx = zmq.Context()
        self._auth = security.authenticator(self._ctx) if security else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if security:
            security.as_server(self._pub)
        (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            if security:
                security.as_server(self._replay)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()

    @property
    def last_endpoint(self) -> str:
        """The PUB socket's resolved endpoint (useful with port 0 / wildcards)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def last_replay_endpoint(self) -> str | None:
        return None if self._replay is None else self._replay.getsockopt_string(
            zmq.LAST_ENDPOINT)

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """Send `events` as one batch; a no-op for an empty list."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        if not events:
            return
        self._queue.put(KVEventBatch(ts=time.time(), events=list(events),
                                     data_parallel_rank=self._rank))

    def close(self, timeout: float = 1.0) -> None:
        """Flush queued batches (up to `timeout`), stop the thread, close sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("kv-event replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is _STOP:
                return
            payload = encode_batch(batch)
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.exception("kv-event publish failed (seq %d kept for replay)", seq)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid kv-event replay request: %d frames", len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client_id, b"", END_SEQ, b""))
