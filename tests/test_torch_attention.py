"""The PyTorch attention backend: low-precision decode path against float32."""

from __future__ import annotations

import torch

from sluice.engine.attention.backend import AttentionMetadata, kv_cache_shape
from sluice.engine.attention.torch_backend import TorchAttentionBackend


def test_bf16_decodes_match_float32():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, group, head_dim = 40, 16, 2, 3, 64
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen)
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
    assert torch.allclose(ref[0], cache[1, tables[0][0], :, 0].repeat_interleave(group, dim=0))


def test_decodes_equal_dense_attention_over_their_own_blocks():
    """Blockwise attention (decodes and few-row steps, padded to the step's most rows) and
    the SDPA prefill path against softmax(q K^T) V written out per sequence, row and head,
    over shuffled tables and partial last blocks, all in one step."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, group, head_dim = 64, 16, 3, 3, 32
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    lens = [1, 16, 17, 45, 130, 9, 60]
    q_lens = [1, 1, 1, 5, 1, 9, 30]  # multi-row (speculative-style) steps and a prefill chunk
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], kv_heads * group, head_dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (10 - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)
    got = TorchAttentionBackend().attend(q, cache, meta, 0.2)
    for i, (n, table) in enumerate(zip(lens, tables)):
        k = torch.cat([cache[0, b] for b in table], dim=1)[:, :n]  # [kv_heads, n, head_dim]
        v = torch.cat([cache[1, b] for b in table], dim=1)[:, :n]
        for row in range(starts[i], starts[i + 1]):
            pos = n - (starts[i + 1] - row)  # absolute position of this query row
            for h in range(kv_heads * group):
                w = (q[row, h] @ k[h // group, :pos + 1].T * 0.2).softmax(-1)
                torch.testing.assert_close(got[row, h], w @ v[h // group, :pos + 1])
