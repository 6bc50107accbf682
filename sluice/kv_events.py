"""KV-cache event wire format, byte-compatible with vLLM's `vllm.distributed.kv_events`.

Leaf module shared by the engine (publisher) and the gateway (subscriber); it
imports nothing from either. Structs are msgspec array-like, tagged by class
name, so `msgspec.msgpack.encode(KVEventBatch(...))` produces exactly what a
vLLM engine puts on its ZMQ PUB socket.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# vLLM's ExternalBlockHash: bytes (sha256 family) or int (builtin hash).
ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of all KV-cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
