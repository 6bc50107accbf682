"""Subscribe to every engine's KV events and keep the prefix index current.

One thread owns all ZMQ sockets (they are not thread-safe). Per pod: a SUB
socket on its event endpoint (all topics) and, if it has one, a DEALER on its
replay endpoint. Catch-up protocol (vLLM's): send the 8-byte big-endian start
seq, read `(seq, payload)` until seq == -1.

- Pod added: connect SUB first, then, if Redis holds the pod's last applied
  seq, warm the local view from Redis and replay from seq + 1 (a restarted
  gateway catches up); otherwise replay from 0.
- The SUB reconnected (its engine may have restarted on the same endpoint,
  its first batches lost: `event_sockets`): each live batch that follows the
  last applied one is caught up first, comparing the batch at the last seq,
  until the engine's answer settles whether it is the same engine.
- Gap in live seqs: replay the missing range. That includes a first live
  batch after an empty catch-up that is not seq 0: a SUB connect is
  asynchronous, and PUB drops what it sends before the subscription is live.
- seq not newer than the last applied one but with a newer timestamp (the last
  one's is kept in Redis), or a catch-up replay whose batch at the last applied
  seq has another timestamp (its seq passed ours): the engine restarted; its old
  entries are dropped (in Redis only if no other replica has rebuilt them from
  the new incarnation yet: `PrefixIndex.restarted`) and it is replayed from 0.
- A replay answer not read to its end (timeout, malformed) leaves a fresh
  DEALER behind (no stale answers); a batch that cannot be translated is skipped.
- Event endpoint moved (`move`): new sockets, same position, caught up from
  there; whether the engine behind it is the same is told by its batches as
  above (a restart is only ever purged under `PrefixIndex.restarted`'s guard, so
  replicas seeing the move at different times do not undo each other's work).
- An error with one pod or batch is logged and counted; the thread goes on.
- Between batches: `PrefixIndex.recover()` when Redis had been unreachable.
Commands (add/move/remove pod) arrive through a bounded queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq

from sluice.gateway.events.replay import batch_ts, read_replay
from sluice.gateway.events.sockets import (
    EventSource,
    PodState,
    ReconnectWatch,
    connect,
    socket_context,
)
from sluice.gateway.events.translate import Translated, translate
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.kv_events import decode_batch
from sluice.zmq_curve import ZmqSecurity

log = logging.getLogger("sluice.gateway.events")


class EventFeeder:
    def __init__(self, index: PrefixIndex, replay_timeout_s: float = 2.0,
                 max_replay_batches: int = 100_000, recover_every_s: float = 0.5,
                 security: ZmqSecurity | None = None) -> None:
        """`security`: CURVE to every pod's event sockets (their engines' key)."""
        self.index = index
        self.security = security
        self.replay_timeout_s = replay_timeout_s
        self.max_replay_batches = max_replay_batches
        self.recover_every_s = recover_every_s
        self._ctx = socket_context()
        self._cmds: queue.Queue = queue.Queue(maxsize=10_000)
        self._pods: dict[str, PodState] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-feeder", daemon=True)
        self.batches = self.blocks = self.orphans = self.restarts = 0
        self.errors = 0  # exceptions survived by the feeder thread

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def add(self, source: EventSource) -> None:
        self._cmds.put(("add", source))

    def move(self, source: EventSource) -> None:
        """The pod's events now come from `source`'s endpoints (or model); its
        entries stay unless its batches show another engine (see above)."""
        self._cmds.put(("move", source))

    def remove(self, pod: str, gone: bool = True) -> None:
        """Unsubscribe and drop the pod's entries (`PrefixIndex.forget_pod`)."""
        self._cmds.put(("remove", (pod, gone)))

    def pods(self) -> list[str]:
        return list(self._pods)

    # -- thread ------------------------------------------------------------------------------
    def alive(self) -> bool:
        """False once the feeder thread has ended (it only ends on `stop()`)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        poller = zmq.Poller()
        next_recover = 0.0
        while not self._stop.is_set():
            try:
                self._round(poller)
            except Exception:
                self.errors += 1
                log.exception("kv-event feeder: error (continuing)")
                self._stop.wait(0.05)
            if time.monotonic() >= next_recover:  # Redis back, or lost its data
                next_recover = time.monotonic() + self.recover_every_s
                try:
                    if self.index.mode == "local":
                        self.index.recover()
                    else:
                        self.index.check_epoch()
                except Exception:
                    self.errors += 1
                    log.exception("kv-event feeder: index recovery failed (retrying)")
        for state in self._pods.values():
            state.close()
        self._ctx.term()

    def _round(self, poller: zmq.Poller) -> None:
        """Commands, then up to 50 ms of live events from every pod."""
        self._drain_commands(poller)
        if not self._pods:  # zmq_poll on no sockets returns at once: don't spin
            self._stop.wait(0.05)
            return
        ready = dict(poller.poll(50))
        for state in list(self._pods.values()):
            if state.sub in ready:
                if state.watch is not None and state.watch.dropped():
                    state.reconnected = True
                for _ in range(1000):  # bounded drain per pod per round
                    try:
                        frames = state.sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_live(state, frames)

    def _drain_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                cmd, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd in ("add", "move") and arg.pod not in self._pods:
                if state := self._subscribe(arg, poller):
                    self._catch_up_new(state)
            elif cmd == "move":
                old = self._pods.pop(arg.pod)
                poller.unregister(old.sub)
                old.close()
                if state := self._subscribe(arg, poller):
                    state.last_seq, state.last_ts = old.last_seq, old.last_ts
                    self._catch_up(state)
                else:  # (a bad endpoint: its entries can no longer be kept current)
                    self.index.forget_pod(arg.pod, gone=False)
            elif cmd == "remove" and arg[0] in self._pods:
                pod, gone = arg
                state = self._pods.pop(pod)
                poller.unregister(state.sub)
                state.close()
                self.index.forget_pod(pod, gone)

    def _subscribe(self, source: EventSource, poller: zmq.Poller) -> PodState | None:
        sub = self._connect(zmq.SUB, source, source.endpoint, "routed on load and "
                            "speculative entries only")
        if sub is None:
            return None
        try:
            watch = ReconnectWatch(sub)
        except zmq.ZMQError as err:  # (out of sockets: fed, without restart detection)
            log.error("%s: no connection watch on its KV-event socket: %s", source.pod, err)
            watch = None
        state = self._pods[source.pod] = PodState(source, sub, self._replay_socket(source),
                                                   watch)
        poller.register(sub, zmq.POLLIN)
        return state

    def _replay_socket(self, source: EventSource) -> zmq.Socket | None:
        if not source.replay_endpoint:
            return None
        return self._connect(zmq.DEALER, source, source.replay_endpoint, "no catch-up")

    def _connect(self, kind: int, source: EventSource, endpoint: str, consequence: str
                 ) -> zmq.Socket | None:
        """`event_sockets.connect`, with CURVE unless the pod says its sockets are plain;
        None (logged and counted) for a bad endpoint or a CURVE pod without our keys."""
        security = None if source.curve is False else self.security
        if source.curve and security is None:
            self.errors += 1
            log.error("%s: its KV-event sockets need CURVE and this picker has no keys "
                      "(--kv-events-curve-dir): %s", source.pod, consequence)
            return None
        try:
            return connect(self._ctx, kind, endpoint, security)
        except zmq.ZMQError as err:
            self.errors += 1
            log.error("%s: bad KV-event endpoint %r (%s): %s", source.pod, endpoint, err,
                      consequence)
            return None

    def _catch_up_new(self, state: PodState) -> None:
        stored = self.index.stored_position(state.source.pod)
        if stored is not None and self.index.warm_from_redis(state.source.pod, *stored):
            state.last_seq, state.last_ts = stored
        self._catch_up(state)

    def _catch_up(self, state: PodState) -> bool:
        """Replay what follows the last applied batch. When that batch's timestamp is
        known the replay starts at it, to compare: a different one there means
        another incarnation of the engine (it restarted, and its seq has already
        passed ours), whose entries are dropped and which is replayed from 0.
        True when that settled which engine it is (the same batch, or another)."""
        check = state.last_seq >= 0 and state.last_ts > 0
        start, expect_ts = state.last_seq, state.last_ts
        start_ts = self._replay(state, start if check else start + 1, expect_ts if check else 0.0)
        if start_ts is not None and start_ts != expect_ts:
            self._restarted(state, (start, start_ts))
        return start_ts is not None

    def _replay(self, state: PodState, start: int, expect_ts: float = 0.0) -> float | None:
        """Apply the engine's buffered batches from `start` on (vLLM's replay protocol).

        With `expect_ts`, batch `start` is the last one applied and is only compared:
        a different timestamp means another incarnation of the engine (it
        restarted) and nothing is applied. Returns batch `start`'s timestamp, if
        compared and found. A request that goes unanswered leaves the socket
        replaced: its late answer must not be read as the answer to the next one."""
        if state.replay is None:
            return None
        complete, start_ts = False, None
        try:
            complete, start_ts = read_replay(
                state, start, expect_ts, self.replay_timeout_s, self.max_replay_batches,
                lambda seq, payload: self._apply(state, seq, payload))
        finally:
            if not complete:  # unread frames must not meet the next request
                state.replay.close(linger=0)
                state.replay = self._replay_socket(state.source)
        return start_ts

    def _on_live(self, state: PodState, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big")
        if seq <= state.last_seq:
            # Not newer: a batch seen twice (replayed, or applied by another replica
            # before this one read Redis), or the engine restarted (its seq starts
            # again at 0) -- told apart by the batch's timestamp, kept in Redis next
            # to the seq. Without one (0.0) only seq 0 counts as a restart.
            ts = batch_ts(frames[2])
            if ts is None:
                return
            restarted = ts > state.last_ts if state.last_ts > 0 else (
                seq == 0 and state.last_seq > 0)
            if restarted:
                self._restarted(state, (seq, ts))
                if seq > state.last_seq:
                    self._apply(state, seq, frames[2])
            return
        if seq > state.last_seq + 1 or state.reconnected:
            # A gap; also batches before a new pod's first live one, sent after its
            # catch-up replay but before its subscription went live (dropped by PUB).
            # Or the SUB reconnected and this batch follows as if nothing happened:
            # is it the same engine? Only the engine's batch at the last seq settles
            # that; until it does, batches queued before the drop may come first.
            if self._catch_up(state):
                state.reconnected = False
            if seq <= state.last_seq:
                return
        self._apply(state, seq, frames[2])

    def _restarted(self, state: PodState, seen: tuple[int, float]) -> None:
        """The engine restarted (its cache is empty), as its batch `seen` (seq, ts) shows:
        drop its entries, replay it from 0."""
        log.warning("%s restarted (batch %d of time %s after %d of time %s): dropping its "
                    "entries", state.source.pod, *seen, state.last_seq, state.last_ts)
        assert seen[0] <= state.last_seq, (seen, state.last_seq)  # (redis_rewrite.CLAIM)
        self.restarts += 1
        self.index.restarted(state.source.pod, state.last_ts, seen)
        state.last_seq, state.last_ts, state.reconnected = -1, 0.0, False
        self._replay(state, 0)

    def _apply(self, state: PodState, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as err:
            log.warning("%s: undecodable event batch %d: %s", state.source.pod, seq, err)
            # skipped; its time is unknown, so no later catch-up compares against it
            state.last_seq, state.last_ts = seq, 0.0
            self.index.mark_partial(state.source.pod)
            return
        pod = state.source.pod
        try:
            t = translate(batch, state.source.model, lambda f: self.index.local.key_of(pod, f))
        except (ValueError, TypeError, OverflowError, AssertionError) as err:
            self.errors += 1
            log.warning("%s: event batch %d skipped: %s", pod, seq, err)
            # skipped once, not replayed forever: applied as empty, so the position
            # (here and in Redis) is that batch's and a later catch-up compares its time
            t = Translated()
            self.index.mark_partial(pod)
        self.index.apply(pod, seq, t.stored, t.removed, t.cleared, t.block_size, batch.ts,
                         complete=seq == state.last_seq + 1)
        state.last_seq, state.last_ts = seq, batch.ts
        self.batches += 1
        self.blocks += len(t.stored) + len(t.removed)
        self.orphans += t.orphans

