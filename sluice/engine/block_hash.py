"""Prefix-cache block hashes.

hash(block i) = H(hash(block i-1) or ROOT, token ids of block i, extra keys),
where extra keys (cache salt, adapter name) enter the first block only, H is
BLAKE2b-64 and ROOT is derived from a fixed seed, so hashes are stable across
processes and restarts (routers may still compute their own keys).
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = int.from_bytes(hashlib.blake2b(b"sluice-prefix-cache-v1", digest_size=8).digest(), "big")


def hash_block(parent: int | None, token_ids: list[int] | tuple[int, ...],
               extra_keys: tuple[str, ...] = ()) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((ROOT_HASH if parent is None else parent).to_bytes(8, "big"))
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return int.from_bytes(h.digest(), "big")


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int,
                        extra_keys: tuple[str, ...] = ()) -> None:
    """Append hashes for every full block of `token_ids` not hashed yet (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        block = token_ids[i * block_size:(i + 1) * block_size]
        hashes.append(hash_block(parent, block, extra_keys if i == 0 else ()))
