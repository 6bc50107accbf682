"""The other gateway replicas' routing decisions, mirrored into this one's view.

A replica that routes on its own view (`--index-reads local`) still has every
confirmed entry (it is fed every engine's events, as Redis is) but not the
speculative entries the other replicas' decisions wrote to Redis. Each such
write is also published on `index_keys.SPEC_CHANNEL` (the SPECULATE script);
`SpecMirror` subscribes on a thread of its own and adds the entries of the
other replicas to the local view, with their expiry. They arrive as they reach
Redis (within the writer's `flush_after_s`), so a burst of one prefix spread
over replicas still sticks to one pod. While Redis is unreachable nothing is
published; the mirror reconnects every `retry_s`, and what was published
meanwhile (entries that expire within seconds anyway) is not recovered.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from redis.exceptions import RedisError

from sluice.gateway.local_index import LocalIndex
from sluice.gateway.redis_index import KEY_WIDTH
from sluice.index_keys import SPEC_CHANNEL

log = logging.getLogger("sluice.gateway.index")


def parse_speculation(message: bytes) -> tuple[str, str, float, list[str]]:
    """(replica, pod, expiry_ms, keys) of one published speculative write;
    ValueError if it is not one."""
    replica, pod, expiry, blob = message.decode().split("\n", 3)
    if not replica or not pod or len(blob) % KEY_WIDTH:
        raise ValueError("not a speculation message")
    keys = [blob[i:i + KEY_WIDTH] for i in range(0, len(blob), KEY_WIDTH)]
    return replica, pod, float(expiry), keys


class SpecMirror:
    def __init__(self, client: Any, local: LocalIndex, replica_id: str,
                 retry_s: float = 0.5) -> None:
        """`client`: a redis-py client (the subscription takes a connection of its
        pool for itself); `replica_id`: this replica's, whose messages are skipped."""
        self.client = client
        self.local = local
        self.replica_id = replica_id
        self.retry_s = retry_s
        self.mirrored = 0  # entries (keys) added to the view
        self.subscribed = threading.Event()
        self._last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spec-mirror", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(SPEC_CHANNEL)
                self.subscribed.set()
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is not None and msg["type"] == "message":
                        self.on_message(msg["data"])
            except (RedisError, OSError) as err:
                if str(err) != self._last_error:  # (once per distinct error, not each retry)
                    log.warning("speculation mirror: %s; other replicas' routing decisions "
                                "are not seen until it reconnects", err)
                self._last_error = str(err)
                self.subscribed.clear()
                self._stop.wait(self.retry_s)
            finally:
                try:
                    pubsub.close()
                except (RedisError, OSError):
                    pass

    def on_message(self, data: bytes) -> None:
        if data.startswith(self.replica_id.encode() + b"\n"):
            return  # this replica's own (already in the view)
        try:
            replica, pod, expiry_ms, keys = parse_speculation(data)
        except (ValueError, UnicodeDecodeError):
            log.warning("speculation mirror: ignored a malformed message on %s", SPEC_CHANNEL)
            return
        if keys:
            self.local.add_speculative(pod, keys, expiry_ms)
            self.mirrored += len(keys)
