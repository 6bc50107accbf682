"""Request keys: the documented chained hash, whatever form the token ids come in.

Keys live in the shared Redis index, so gateway replicas of different versions
must compute the same ones: the definition is pinned by golden values."""

import hashlib
import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.gateway.prompt.block_keys import chain_keys, request_keys, root_key


def by_the_definition(model: str, block_size: int, ids: list[int]) -> list[str]:
    parent = hashlib.blake2b(f"sluice-keys-v1\x00{model}\x00{block_size}".encode(),
                             digest_size=8).digest()
    keys = []
    for b in range(len(ids) // block_size):
        block = ids[b * block_size:(b + 1) * block_size]
        data = struct.pack(f"<{block_size}I", *(t % 2**32 for t in block))
        parent = hashlib.blake2b(parent + data, digest_size=8).digest()
        keys.append(parent.hex())
    return keys


def test_golden_keys():
    want = ["cfe4da3cfdfbb9cc", "2009c4cf91981059"]
    assert request_keys("SmolLM2", 4, list(range(10))) == want
    assert by_the_definition("SmolLM2", 4, list(range(10))) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([1, 2, 16, 32]))
def test_keys_follow_the_definition(ids, block_size):
    want = by_the_definition("m", block_size, ids)
    assert request_keys("m", block_size, ids) == want
    assert request_keys("m", block_size, np.asarray(ids, dtype=np.int64)) == want
    assert chain_keys(root_key("m", block_size), ids, block_size) == want


def test_ids_outside_uint32_wrap_like_numpy():
    ids = [-1, 2**32 + 5, 7, 2**40]
    assert request_keys("m", 2, ids) == by_the_definition("m", 2, ids)


def test_only_full_blocks_and_chaining():
    keys = request_keys("m", 16, list(range(40)))
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    assert request_keys("m", 16, list(range(32))) == keys          # the tail adds nothing
    assert request_keys("m", 16, [0] + list(range(1, 40)))[0] == keys[0]
    assert request_keys("m", 16, [1] + list(range(1, 40)))[1] != keys[1]  # chained
    assert request_keys("other", 16, list(range(40)))[0] != keys[0]     # seeded by model
