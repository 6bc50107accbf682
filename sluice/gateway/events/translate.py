"""Translate one engine's KV event batch into request-key operations ("dual keys").

For `BlockStored`, the request key of each block is chained from the key of
its parent: the parent's engine hash is looked up in the pod's map (the local
view, which a restarted gateway warms from Redis), or the root when the
parent is None: the model's, or a LoRA adapter's for a block stored under
one (vLLM hashes the adapter's name into its blocks: requests naming the
adapter are keyed with its name, `PodRegistry.key_model`). A block under an
adapter that the event names only by `lora_id` (older vLLM) gets a root no
request has: such blocks never count as another model's hits. Blocks whose parent is unknown cannot be keyed and are
counted as orphans (they are also absent from every request's run, so
skipping them never creates a false hit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.gateway.prompt.block_keys import chain_keys, root_key
from sluice.index_keys import engine_hash_field
from sluice.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


@dataclass
class Translated:
    stored: list[tuple[str, str]] = field(default_factory=list)  # (engine hash field, key)
    removed: list[str] = field(default_factory=list)
    cleared: bool = False
    block_size: int | None = None
    orphans: int = 0


def translate(batch: KVEventBatch, model: str,
              key_of: Callable[[str], str | None]) -> Translated:
    """Effects of `batch` for one pod; `key_of(field)` resolves a known engine hash.

    Events inside a batch are in order; a clear drops everything before it.
    """
    out = Translated()
    pending: dict[str, str] = {}  # keys stored earlier in this batch
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            out = Translated(cleared=True, orphans=out.orphans, block_size=out.block_size)
            pending.clear()
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                f = engine_hash_field(h)
                pending.pop(f, None)
                out.removed.append(f)
        elif isinstance(ev, BlockStored):
            bs = ev.block_size
            out.block_size = bs
            if ev.parent_block_hash is None:
                parent = root_key(_seed(ev, model), bs)
            else:
                pf = engine_hash_field(ev.parent_block_hash)
                pk = pending.get(pf) or key_of(pf)
                if pk is None:
                    out.orphans += len(ev.block_hashes)
                    continue
                parent = bytes.fromhex(pk)
            keys = chain_keys(parent, ev.token_ids, bs)
            if len(keys) != len(ev.block_hashes):  # malformed event: skip it whole
                out.orphans += len(ev.block_hashes)
                continue
            for h, k in zip(ev.block_hashes, keys):
                f = engine_hash_field(h)
                pending[f] = k
                if f in out.removed:
                    out.removed.remove(f)
                out.stored.append((f, k))
    return out


def _seed(ev: BlockStored, model: str) -> str:
    """The name a root block's key is seeded with (see the module docstring)."""
    if ev.lora_name:
        return ev.lora_name
    if ev.lora_id is not None:
        return f"{model}\x00lora_id\x00{ev.lora_id}"
    return model
