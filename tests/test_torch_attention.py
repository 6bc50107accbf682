"""The PyTorch attention backend: low-precision decode path against float32."""

from __future__ import annotations

import torch

from sluice.engine.attention.backend import AttentionMetadata
from sluice.engine.attention.torch_backend import TorchAttentionBackend


def test_bf16_decodes_match_float32():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, group, head_dim = 40, 16, 2, 3, 64
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    lens = [1, 17, 100, 260]  # decodes at various context lengths (incl. a block boundary + 1)
    tables, next_block = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)) + [0] * (17 - count))
        next_block += count
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc_cpu=list(range(len(lens) + 1)), seq_lens_cpu=lens)
    backend = TorchAttentionBackend()
    ref = backend.attend(q, cache, meta, head_dim ** -0.5)
    low = backend.attend(q.bfloat16(), cache.bfloat16(), meta, head_dim ** -0.5)
    assert low.dtype == torch.bfloat16
    assert torch.allclose(low.float(), ref, atol=3e-2, rtol=3e-2)
    # Each decode attends only to its own context: the 1-token context returns its value row.
    assert torch.allclose(ref[0], cache[1, tables[0][0], 0].repeat_interleave(group, dim=0))
