"""The other gateway replicas' routing decisions, mirrored into this one's view.

A replica that routes on its own view (`--index-reads local`) still has every
confirmed entry (it is fed every engine's events, as Redis is) but not the
speculative entries the other replicas' decisions wrote to Redis. Each such
write is also published on `index_keys.SPEC_CHANNEL` (the SPECULATE script)
while someone besides the writer's own mirror listens; `SpecMirror` subscribes
on a thread of its own and adds the entries of the other replicas to the local
view, with their expiry. They arrive as they reach Redis (within the writer's
`flush_after_s`), so a burst of one prefix spread over replicas still sticks to
one pod. While Redis is unreachable nothing is published; the mirror reconnects
every `retry_s`, and what was published meanwhile (entries that expire within
seconds anyway) is not recovered; nor is what a replica whose subscription
Redis dropped, unnoticed yet, left unpublished for one other listener. Its own
PINGs tell a connection that went silent (half-open) from an idle one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.redis_index import KEY_WIDTH
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
                 max_ttl_ms: float, retry_s: float = 0.5, ping_every_s: float = 1.0,
                 silence_limit_s: float = 3.0) -> None:
        """`client`: a redis-py client (the subscription takes a connection of its
        pool for itself); `replica_id`: this replica's, whose messages are skipped.
        An entry lasts at most `max_ttl_ms` from its arrival, whatever the message
        says: only what a replica could have sent is taken (a publisher that is not
        one cannot pin a prefix to a pod). A PING goes out every `ping_every_s`; a
        connection that has said nothing for `silence_limit_s` (no pong: half-open,
        or Redis hung) is replaced."""
        assert 0 < ping_every_s < silence_limit_s and max_ttl_ms > 0
        self.max_ttl_ms = max_ttl_ms
        self.client = client
        self.local = local
        self.replica_id = replica_id
        self._own = replica_id.encode() + b"\n"  # how this replica's messages start
        self.retry_s = retry_s
        self.ping_every_s = ping_every_s
        self.silence_limit_s = silence_limit_s
        self.mirrored = 0  # entries (keys) added to the view
        self.subscribed = threading.Event()  # set while Redis confirms the subscription
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
            pubsub = self.client.pubsub()
            try:
                self._listen(pubsub)
            except (RedisError, OSError) as err:
                self.subscribed.clear()
                if str(err) != self._last_error:  # (once per distinct error, not each retry)
                    log.warning("speculation mirror: %s; other replicas' routing decisions "
                                "are not seen until it reconnects", err)
                self._last_error = str(err)
                self._stop.wait(self.retry_s)
            finally:
                try:
                    pubsub.close()
                except (RedisError, OSError):
                    pass
        self.subscribed.clear()

    def _listen(self, pubsub: Any) -> None:
        """Subscribe and mirror until stopped; RedisError when the connection fails
        or has been silent for `silence_limit_s` despite a PING every `ping_every_s`
        (a TCP connection whose peer vanished can otherwise look open for ~15 min)."""
        pubsub.subscribe(SPEC_CHANNEL)
        heard = next_ping = time.monotonic()
        while not self._stop.is_set():
            msg = pubsub.get_message(timeout=0.2)
            now = time.monotonic()
            if msg is not None:
                heard = now
                if msg["type"] == "message":
                    self.on_message(msg["data"])
                elif msg["type"] == "subscribe":
                    self.subscribed.set()
            elif now - heard > self.silence_limit_s:
                raise RedisConnectionError(
                    f"no answer from Redis for {self.silence_limit_s:g} s")
            if now >= next_ping:
                pubsub.ping()
                next_ping = now + self.ping_every_s

    def on_message(self, data: bytes) -> None:
        if data.startswith(self._own):
            return  # this replica's own (already in the view)
        try:
            _, pod, expiry_ms, keys = parse_speculation(data)
        except (ValueError, UnicodeDecodeError):
            log.warning("speculation mirror: ignored a malformed message on %s", SPEC_CHANNEL)
            return
        if keys:
            expiry_ms = min(expiry_ms, time.time() * 1000.0 + self.max_ttl_ms)
            self.local.add_speculative(pod, keys, expiry_ms)
            self.mirrored += len(keys)
