"""KV-cache event wire format, byte-compatible with vLLM's `vllm.distributed.kv_events`.

Leaf module shared by the engine (publisher) and the gateway (subscriber); it
imports nothing from either. The struct definitions mirror vLLM's current
source field for field (names, order, defaults, `omit_defaults`, `tag=True`):
since vLLM PR #42892 the structs are map-encoded (no `array_like`), the tag is
the class name under the key `"type"`. `lora_name` is a required field in
vLLM (no default) and so it is here: pass `lora_name=None`.

`decode_batch` additionally accepts the older encodings still on the wire
from deployed vLLM versions: the fully positional one (`array_like=True`,
vLLM <= 0.2x) and the mixed one (positional batch, map-encoded events).

Transport (vLLM's `ZmqEventPublisher`): PUB multipart
`(topic, seq.to_bytes(8, "big"), payload)`; replay over ROUTER: a REQ/DEALER
client sends `start_seq.to_bytes(8, "big")`, the server answers one
`(seq, payload)` message per buffered batch with seq >= start, then
`((-1).to_bytes(8, "big", signed=True), b"")`.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's ExternalBlockHash: bytes (sha256 family) or int (builtin hash).
ExternalBlockHash = bytes | int

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of all KV-cache events."""


MEDIUM_GPU = "GPU"


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES: dict[str, type] = {c.__name__: c for c in (BlockStored, BlockRemoved,
                                                          AllBlocksCleared)}
_encoder = msgspec.msgpack.Encoder()
_typed_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_raw_decoder = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack payload exactly as vLLM's publisher encodes it."""
    return _encoder.encode(batch)


def _event_from_raw(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        cls = _EVENT_TYPES.get(raw.get("type"))
        if cls is None:
            return None
        fields = {f: raw.get(f) for f in cls.__struct_fields__ if f in raw}
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        cls = _EVENT_TYPES.get(raw[0])
        if cls is None:
            return None
        fields = dict(zip(cls.__struct_fields__, raw[1:]))
    else:
        return None
    for name in cls.__struct_fields__:  # fields older encodings lack
        fields.setdefault(name, None)
    return msgspec.convert(fields, cls)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload from any vLLM version (map, positional, or mixed).

    Unknown event types are skipped (forward compatibility); a payload that is
    not a batch at all raises `msgspec.DecodeError` or `TypeError`.
    """
    try:
        return _typed_decoder.decode(payload)
    except msgspec.ValidationError:
        pass
    raw = _raw_decoder.decode(payload)
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise TypeError(f"not a KV event batch: {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise TypeError("not a KV event batch: bad ts or events")
    parsed = [e for e in (_event_from_raw(r) for r in events) if e is not None]
    return KVEventBatch(ts=float(ts), events=parsed, data_parallel_rank=rank)
