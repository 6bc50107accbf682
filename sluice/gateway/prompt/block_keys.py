"""Gateway request keys: a chained hash over full token blocks.

key(block i) = BLAKE2b-64(key(block i-1) or ROOT(model, block_size), token ids of
block i as little-endian uint32). Keys are 16 lowercase hex chars. They depend
only on the model name, the block size and the tokens, never on an engine's
hash seed: the gateway maps each engine block hash to the key it computes
from the token ids that engine's `BlockStored` event carries ("dual keys").
Only full blocks get keys, as only full blocks are cached by engines.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from functools import lru_cache

import numpy as np


def key_seed(model: str, cache_salt: str | None = None) -> str:
    """The name a request's keys are seeded with. A request with a `cache_salt` gets
    keys of its own: engines do not reuse blocks across salts, and KV events do not
    carry the salt, so such a request's hits come only from routing decisions
    (speculative entries), never from a pod holding the tokens under another salt."""
    return f"{model}\x00cache_salt\x00{cache_salt}" if cache_salt else model


@lru_cache(maxsize=256)
def root_key(model: str, block_size: int) -> bytes:
    """8-byte seed of the chain for one model and block size."""
    assert block_size > 0
    return hashlib.blake2b(f"sluice-keys-v1\x00{model}\x00{block_size}".encode(),
                           digest_size=8).digest()


def _le_u32(token_ids: list[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (ids outside uint32 wrap, as numpy casts)."""
    if isinstance(token_ids, list) and sys.byteorder == "little":
        try:
            return array("I", token_ids).tobytes()  # ~3x faster than numpy from a list
        except (OverflowError, TypeError):
            pass
    return np.asarray(token_ids, dtype=np.int64).astype("<u4", copy=False).tobytes()


def chain_keys(parent: bytes, token_ids: list[int] | np.ndarray, block_size: int) -> list[str]:
    """Keys of the full blocks of `token_ids`, chained from the 8-byte `parent`."""
    assert len(parent) == 8 and array("I").itemsize == 4
    raw = _le_u32(token_ids)
    width = 4 * block_size
    blake2b = hashlib.blake2b
    keys: list[str] = []
    for start in range(0, len(raw) - width + 1, width):
        parent = blake2b(parent + raw[start:start + width], digest_size=8).digest()
        keys.append(parent.hex())
    return keys


def request_keys(model: str, block_size: int, token_ids: list[int] | np.ndarray) -> list[str]:
    """Keys of every full block of a prompt, from the root."""
    return chain_keys(root_key(model, block_size), token_ids, block_size)
