"""One answer of vLLM's KV-event replay protocol, read and applied (see event_feed).

The request is the 8-byte big-endian start seq; the answer is `(seq, payload)`
frames (an empty delimiter first on a DEALER, a topic tolerated) ending with
seq -1."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from sluice.kv_events import decode_batch

log = logging.getLogger("sluice.gateway.events")


def read_replay(state: Any, start: int, expect_ts: float, timeout_s: float,
                max_batches: int, apply: Callable[[int, bytes], None]
                ) -> tuple[bool, float | None]:
    """Send the request on `state.replay` and `apply` the batches newer than
    `state.last_seq` (which `apply` advances): (whether the answer was read to its
    end, the timestamp of batch `start` or None). With `expect_ts`, batch `start`
    is the last one applied and is only compared: another timestamp there ends the
    read (another incarnation of the engine). None: the engine no longer (or not
    yet) has that batch, or it is undecodable."""
    pod = state.source.pod
    state.replay.send_multipart((b"", start.to_bytes(8, "big")))
    deadline = time.monotonic() + timeout_s
    start_ts = None
    for _ in range(max_batches + 1):
        left = deadline - time.monotonic()
        if left <= 0 or not state.replay.poll(int(left * 1000)):
            log.warning("replay from %s timed out", pod)
            return False, None
        frames = state.replay.recv_multipart()
        frames = frames[1:] if frames and frames[0] == b"" else frames
        if len(frames) < 2:
            log.warning("%s: malformed replay answer (%d frames)", pod, len(frames))
            return False, None
        seq_bytes, payload = frames[-2], frames[-1]  # tolerate (topic, seq, payload)
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq < 0:
            return True, start_ts
        if expect_ts and seq == start:
            start_ts = batch_ts(payload)
            if start_ts not in (expect_ts, None):  # (an undecodable batch is no evidence)
                return False, start_ts
        if seq > state.last_seq:
            if state.last_seq >= 0 and seq > state.last_seq + 1:
                log.warning("%s: events %d..%d are no longer in the engine's replay "
                            "buffer", pod, state.last_seq + 1, seq - 1)
            apply(seq, payload)
    return False, None


def batch_ts(payload: bytes) -> float | None:
    """The timestamp of an encoded batch (None: undecodable)."""
    try:
        return decode_batch(payload).ts
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
        return None
