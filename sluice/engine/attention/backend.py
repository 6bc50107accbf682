"""The attention-backend plug point.

A step's tokens are one flat, variable-length batch: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]` and, after this step, `seq_lens[i]`
tokens of context whose K/V live in the paged cache at the blocks listed in
`block_tables[i]`. The new tokens' K/V are written to `slot_mapping`
(slot = block_id * block_size + offset) before attention reads them, so a
prefill chunk attends causally to its cached prefix and to itself, and a decode
attends to everything before it.

The cache layout, one for every backend: a layer's cache is
[2 (K, V), num_blocks, kv_heads, block_size, head_dim]. Head-major within a block,
so one head's keys of one block are a contiguous [block_size, head_dim] tile: the
CPU decode multiplies those tiles in place of gathered copies (3-4x faster per
layer than token-major blocks, docs/benchmarks.md), and Triton loads them whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from sluice.engine.attention.kv_quant import KVScale

UNSCALED = KVScale()

def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, num_kv_heads, block_size, head_dim)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded
    # Host copies for backends that loop in Python (the CPU reference).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Backend-private data derived from the fields above, built by the first layer that
    # needs it and reused by every other layer of the step.
    plan: Any = field(default=None, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Paged attention for one layer; `kv_cache` has the shape `kv_cache_shape` gives, in the
    model's dtype or fp8 (kv_quant.py: stored = x / kv_scale, read back times it)."""

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, kv_scale: KVScale = UNSCALED) -> None:
        """Store this step's keys/values ([num_tokens, kv_heads, head_dim]) at their slots."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scale: KVScale = UNSCALED) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> output of the same shape (causal, GQA)."""
