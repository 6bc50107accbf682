"""The CPU paged attention kernel (csrc/paged_attention.c, the op
`torch.ops.sluice.paged_attention`) on the engine's tensors.
"""

from __future__ import annotations

import torch

from sluice.engine.attention.kv_quant import FP8, KVScale

DTYPES = (torch.float32, torch.bfloat16)
MAX_BLOCK_SIZE = MAX_HEAD_DIM = 256  # paged_attention.c's MAX_BLOCK and MAX_DIM


def supports(dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """dtype: q's and out's; kv_dtype: the cache's (the same, or fp8)."""
    return (dtype in DTYPES and kv_dtype in (dtype, FP8) and block_size <= MAX_BLOCK_SIZE
            and head_dim <= MAX_HEAD_DIM)


def paged_attention(ops, q: torch.Tensor, out: torch.Tensor,
                    kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_rows: torch.Tensor,
                    q_starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, kv_scale: KVScale) -> None:
    """Writes out[rows of the listed items] (q, out: [num_tokens, heads, head_dim]).

    seq_rows, q_starts, q_lens, seq_lens: int32 [num_items], each item's row in block_tables,
    first query row, query rows, and context length up to its last query row. An item is a
    sequence's whole step or, for a prefill chunk, a tile of its rows.
    """
    block_size, head_dim = kv_cache.shape[3:]
    assert supports(q.dtype, kv_cache.dtype, block_size, head_dim), (
        q.dtype, kv_cache.dtype, block_size, head_dim)
    ops.paged_attention(q, out, kv_cache[0], kv_cache[1], block_tables, seq_rows, q_starts,
                        q_lens, seq_lens, scale, kv_scale.k, kv_scale.v)
