"""Paged attention on the GPU with Triton kernels (`triton_kernels.py`).

`TritonAttentionBackend` implements `AttentionBackend` for one flat varlen step: a KV write
kernel, then one paged-attention launch for all prefill chunks and decodes, followed by a
split-KV reduce when the batch is small enough to need more programs than it has sequences.

CUDA graphs: the kernels read only the device tensors `slot_mapping`, `query_start_loc`,
`seq_lens` and `block_tables`; launch grids, compile-time constants and scratch sizes depend
only on tensor shapes (num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_seqs =
len(seq_lens)) and on constructor settings, never on the host-side `*_cpu` lists. A captured batch padded to a fixed size therefore replays correctly as long as
its padding follows this contract:
  - padded tokens: slot_mapping = -1 (not written); their output rows are unspecified;
  - padded sequences: query length 0 (query_start_loc repeats its last value), any seq_len;
    or query length 1 with seq_len 0 (its slot -1): attends to nothing, output row 0.
  - padded block-table entries may hold anything: only entries < cdiv(seq_len, block_size)
    are read.
Tokens past query_start_loc[-1] are never attended; their output rows are unspecified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from sluice.engine.attention.backend import UNSCALED, AttentionBackend, AttentionMetadata
from sluice.engine.attention.kv_quant import FP8, KVScale
from sluice.engine.attention.triton_kernels import (
    paged_attention_kernel,
    split_kv_reduce_kernel,
    write_kv_kernel,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttentionLaunch:
    """One paged-attention launch: grid (query blocks, KV heads, splits), warps, constexprs."""
    grid: tuple[int, int, int]
    num_splits: int
    num_warps: int
    constexprs: dict = field(hash=False)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention.

    max_num_splits: upper bound on split-KV programs per (query block, KV head); a power of 2.
    target_programs: the split count is the smallest power of two s (<= max_num_splits) with
        upper_bound_query_blocks * num_kv_heads * s >= target_programs; default 2 x SM count on
        CUDA, 8 elsewhere. Both depend only on shapes, so a captured graph keeps its split count.
    max_split_tokens: batches with more tokens than this never split (prefill is already wide,
        and the fp32 scratch is num_tokens * num_heads * splits * head_dim).
    """

    def __init__(self, max_num_splits: int = 16, target_programs: int | None = None,
                 max_split_tokens: int = 256):
        assert max_num_splits >= 1 and max_num_splits & (max_num_splits - 1) == 0, \
            "max_num_splits must be a power of two"
        self.max_num_splits = max_num_splits
        self.target_programs = target_programs
        self.max_split_tokens = max_split_tokens
        # plan() is a pure function of its arguments; every layer of a step asks for the same.
        self._plans: dict[tuple, AttentionLaunch] = {}

    # -- KV write ---------------------------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, kv_scale: KVScale = UNSCALED) -> None:
        """k, v: [num_tokens, kv_heads, head_dim]; token i goes to slot meta.slot_mapping[i]
        (block * block_size + offset); slots < 0 are skipped. Reads only `slot_mapping`."""
        num_tokens, num_kv_heads, head_dim = k.shape
        _check_cache(kv_cache, num_kv_heads, head_dim)
        assert v.shape == k.shape, "k and v shapes differ"
        assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
        assert meta.slot_mapping.shape == (num_tokens,), "one slot per token"
        if num_tokens == 0:
            return
        write_kv_kernel[(num_tokens,)](
            k, v, kv_cache, meta.slot_mapping, kv_scale.k, kv_scale.v,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *_cache_strides(kv_cache),
            NUM_KV_HEADS=num_kv_heads, HEADS_P2=_pow2(num_kv_heads),
            HEAD_DIM=head_dim, HEAD_DIM_P2=_pow2(head_dim), BLOCK_SIZE=kv_cache.shape[3],
            FP8=kv_cache.dtype == FP8,
        )

    # -- attention --------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scale: KVScale = UNSCALED) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim], causal with GQA
        (query head h reads KV head h // (heads // kv_heads)). Reads `query_start_loc`,
        `seq_lens`, `block_tables` on the device; the step's K/V must already be written."""
        num_tokens, num_heads, head_dim = q.shape
        _, _, num_kv_heads, block_size, _ = kv_cache.shape
        _check_cache(kv_cache, num_kv_heads, head_dim)
        assert kv_cache.dtype in (q.dtype, FP8), "the cache holds q's dtype or fp8"
        assert q.stride(2) == 1, "head_dim must be contiguous"
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        num_seqs = meta.seq_lens.shape[0]
        assert meta.query_start_loc.shape == (num_seqs + 1,), "query_start_loc is num_seqs + 1"
        assert meta.block_tables.shape[0] == num_seqs and meta.block_tables.stride(1) == 1
        out = torch.empty_like(q)
        if num_tokens == 0 or num_seqs == 0:
            return out
        key = (num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q.dtype,
               q.device)
        lp = self._plans.get(key)
        if lp is None:
            if len(self._plans) >= 4096:  # eager steps vary num_tokens/num_seqs: stay bounded
                self._plans.clear()
            lp = self._plans[key] = self.plan(*key)
        if lp.num_splits > 1:
            part_out = torch.empty((num_tokens, num_heads, lp.num_splits, head_dim),
                                   dtype=torch.float32, device=q.device)
            part_lse = torch.empty((num_tokens, num_heads, lp.num_splits),
                                   dtype=torch.float32, device=q.device)
        else:  # not read by the kernel when NUM_SPLITS == 1
            part_out = part_lse = out
        paged_attention_kernel[lp.grid](
            q, kv_cache, out, part_out, part_lse,
            meta.query_start_loc, meta.seq_lens, meta.block_tables,
            num_seqs, scale * 1.4426950408889634,  # log2(e): softmax via exp2
            kv_scale.k, kv_scale.v,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *_cache_strides(kv_cache),
            meta.block_tables.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            num_warps=lp.num_warps, FP8=kv_cache.dtype == FP8, **lp.constexprs,
        )
        if lp.num_splits > 1:
            split_kv_reduce_kernel[(num_tokens, num_heads)](
                part_out, part_lse, out,
                part_out.stride(0), part_out.stride(1), part_out.stride(2),
                part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, HEAD_DIM_P2=_pow2(head_dim), NUM_SPLITS=lp.num_splits,
            )
        return out

    def plan(self, num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
             head_dim: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> AttentionLaunch:
        """The paged-attention launch for a batch of these shapes (a pure function of them).

        Rows per program = BLOCK_Q tokens x QPK_P2 heads, at least 16 (tl.dot's minimum).
        Batches of <= max_split_tokens tokens (decodes, small mixed steps) take 16-row programs,
        32-key tiles, and split-KV; wider batches (prefill) take 64-row programs and 64-key
        tiles (32 in fp32) with 8 warps, no split. Register use of these tiles on sm_90 is
        checked (no spills) by tests/test_triton_attention.py::test_compiles_for_sm90.
        """
        qpk = num_heads // num_kv_heads
        qpk_p2 = _pow2(qpk)
        small = num_tokens <= self.max_split_tokens
        block_m = max(16 if small else 64, qpk_p2)
        block_q = block_m // qpk_p2
        tile_n = 32 if small or dtype == torch.float32 else 64
        num_warps = 4 if small and dtype != torch.float32 else 8
        num_q_blocks = num_tokens // block_q + num_seqs
        num_splits = self._num_splits(num_q_blocks * num_kv_heads, small, device)
        constexprs = {
            "QPK": qpk, "QPK_P2": qpk_p2, "HEAD_DIM": head_dim,
            "HEAD_DIM_P2": max(_pow2(head_dim), 16), "BLOCK_SIZE": block_size,
            "BLOCK_Q": block_q, "TILE_N": tile_n, "NUM_SPLITS": num_splits,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
        return AttentionLaunch((num_q_blocks, num_kv_heads, num_splits), num_splits, num_warps,
                               constexprs)

    def _num_splits(self, programs: int, small: bool, device: torch.device) -> int:
        """Split count from shapes only: the smallest power of two that reaches the target
        number of programs, capped at max_num_splits; 1 for wide batches."""
        if not small:
            return 1
        target = self.target_programs
        if target is None:
            target = (2 * torch.cuda.get_device_properties(device).multi_processor_count
                      if device.type == "cuda" else 8)
        splits = 1
        while splits < self.max_num_splits and programs * splits < target:
            splits *= 2
        return splits


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The kernels' (K/V, block, offset, head) strides of the [2, blocks, heads, offsets,
    head_dim] layout."""
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(3), kv_cache.stride(2)


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, \
        "kv_cache is [2, num_blocks, kv_heads, block_size, head_dim]"
    assert kv_cache.shape[2] == num_kv_heads and kv_cache.shape[4] == head_dim, \
        "kv_cache heads/head_dim do not match"
    assert kv_cache.stride(4) == 1, "kv_cache head_dim must be contiguous"
    assert kv_cache.dtype in (*_DTYPES, FP8), f"unsupported dtype {kv_cache.dtype}"
