"""The event feeder's per-pod state: its ZMQ sockets (SUB on the event
endpoint, DEALER on the replay endpoint, a watch on the SUB's connection) and
the last batch applied.

A reconnection is how an engine that restarted on the same endpoint first
shows: the batches its new incarnation published before the SUB reconnected
are lost (PUB drops what no subscriber takes), so the first batch seen may
follow the last one applied by seq as if nothing happened. `ReconnectWatch`
tells the feeder, which then compares the engine's batch at the last applied
seq by replay before it applies the next (`EventFeeder._on_live`).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from sluice.zmq_curve import ZmqSecurity


def socket_context() -> zmq.Context:
    """A ZMQ context of the feeder's own: a pod takes 4 sockets (SUB, DEALER, the
    SUB's monitor pair), so ZMQ's default cap of 1023 would stop one gateway at
    ~255 pods; it is raised to the library's limit."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
    return ctx


def connect(ctx: zmq.Context, kind: int, endpoint: str,
            security: ZmqSecurity | None = None) -> zmq.Socket:
    """A SUB (all topics) or DEALER socket connected to `endpoint` (a CURVE client
    with `security`); ZMQError when the endpoint is not a valid ZMQ address."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        security.as_client(sock)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 100_000)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


class ReconnectWatch:
    """Watches one socket's connection for drops (a monitor socket)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def dropped(self) -> bool:
        """True if the connection dropped since the last call (ZMQ reconnects it)."""
        dropped = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return dropped
            dropped |= event["event"] == zmq.EVENT_DISCONNECTED

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)


@dataclass(frozen=True)
class EventSource:
    pod: str                     # host:port of the engine's HTTP server
    model: str                   # served model name (seeds the request keys)
    endpoint: str                # e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None  # e.g. tcp://10.0.0.5:5558
    curve: bool | None = None    # False: plain sockets even when the feeder has CURVE keys


@dataclass
class PodState:
    source: EventSource
    sub: zmq.Socket
    replay: zmq.Socket | None
    watch: ReconnectWatch | None = None
    last_seq: int = -1
    last_ts: float = 0.0
    reconnected: bool = False  # the SUB's connection dropped; the engine not yet compared

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
