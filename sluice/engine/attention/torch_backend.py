"""Paged attention in plain PyTorch: the reference the compiled CPU kernel and the GPU
kernels are tested against, and the CPU path where the kernel cannot be built.

Sequences with few query tokens (decodes, and the k+1 rows a speculative step verifies:
up to MAX_BLOCKWISE_QUERIES) are batched into one blockwise computation that reads each
KV block in place of a gathered per-sequence copy:

  1. every such sequence's blocks, in table order, are listed once per step (`BlockPlan`);
  2. scores: each block's [block_size, head_dim] key tile times its sequence's query rows
     (all of them at once), one batched matmul over (block, kv_head);
  3. the scores (small: rows x keys) are laid out padded per sequence, masked causally
     (query row r of a q-row step sees the first seq_len - q + r + 1 keys), and softmaxed
     in float32;
  4. each block's probabilities times its value tile, summed per sequence in float32.

Only steps 2 and 4 touch K/V, each reading a block once. Measured against gathering
[B, L, kv_heads, head_dim] copies and multiplying those: 2.6 vs 11-17 ms per layer for
32 decodes at 150-550 tokens of context (bfloat16, one thread). Sequences with fewer rows
than the step's most are padded with copies of their last row (same query, same keys:
the same output, written twice).

Longer query spans (prefill chunks) run one sequence at a time through SDPA (4-D inputs
take CPU SDPA's flash kernel) with a causal mask offset by the cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.engine.attention.backend import UNSCALED, AttentionBackend, AttentionMetadata
from sluice.engine.attention.kv_quant import KVScale, dequantize, quantize, storage

MAX_BLOCKWISE_QUERIES = 16


@dataclass(frozen=True)
class BlockPlan:
    """Index tensors of one step's few-query sequences, shared by every layer."""

    rows: torch.Tensor  # [B, Q] query rows of each sequence, the last repeated as padding
    blocks: torch.Tensor  # [N] the sequences' cache blocks, sequence by sequence, table order
    seq_of_block: torch.Tensor  # [N] sequence (0..B-1) owning each listed block
    padded_index: torch.Tensor  # [N] position of each block in a [B, width] padded layout
    key_mask: torch.Tensor  # [B, Q, width * block_size] True where row r may see the key
    width: int  # blocks of the longest sequence


@dataclass(frozen=True)
class AttentionItems:
    """Attention work items, int32 [N] each: a few-query sequence's step, or (build_plan's
    prefill_tile) a tile of a prefill chunk's rows. The compiled CPU kernel's input."""

    seq_rows: torch.Tensor  # the sequence's row in block_tables (= its index in the step)
    q_starts: torch.Tensor  # first query row
    q_lens: torch.Tensor  # query rows (1 for a decode)
    seq_lens: torch.Tensor  # context length up to the item's last query row


@dataclass(frozen=True)
class StepPlan:
    # Row of each new token's each head in a layer's K (or V) cache seen as
    # [num_blocks * kv_heads * block_size, head_dim]: [num_tokens * kv_heads], token-major.
    write_rows: torch.Tensor
    items: AttentionItems | None
    blockwise: BlockPlan | None  # built only for backends that run `_blockwise`
    prefills: tuple[int, ...]  # sequences with more than MAX_BLOCKWISE_QUERIES query rows


def build_plan(meta: AttentionMetadata, block_size: int, kv_heads: int,
               blockwise: bool = True, prefill_tile: int = 0) -> StepPlan:
    """blockwise: build the BlockPlan `_blockwise` reads. prefill_tile > 0: prefill chunks
    join the items as tiles of that many query rows (for a kernel that walks them like
    decodes: rows [a, b) of a q-row chunk are a (b - a)-row step of a context shorter by
    q - b) instead of going to `prefills`."""
    assert not (blockwise and prefill_tile), "the blockwise path takes no prefill tiles"
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
    few = [i for i, q in enumerate(q_lens) if 1 <= q <= MAX_BLOCKWISE_QUERIES]
    prefills = tuple(i for i, q in enumerate(q_lens) if q > MAX_BLOCKWISE_QUERIES)
    slots = meta.slot_mapping.long()
    items = plan = None
    rows = [(i, starts[i], q_lens[i], lens[i]) for i in few]
    if prefill_tile:
        for i in prefills:
            for a in range(0, q_lens[i], prefill_tile):
                b = min(a + prefill_tile, q_lens[i])
                rows.append((i, starts[i] + a, b - a, lens[i] - q_lens[i] + b))
        prefills = ()
    if rows:
        items = AttentionItems(*(torch.tensor(v, dtype=torch.int32) for v in zip(*rows)))
    if few and blockwise:
        num_q = max(q_lens[i] for i in few)
        num_blocks = torch.tensor([-(-lens[i] // block_size) for i in few])
        width = int(num_blocks.max())
        tables = meta.block_tables[torch.tensor(few), :width].long()
        listed = torch.arange(width).unsqueeze(0) < num_blocks.unsqueeze(1)  # [B, width]
        r = torch.arange(num_q)
        q_len = items.q_lens.long().unsqueeze(1)  # [B, 1]
        r = torch.minimum(r.unsqueeze(0), q_len - 1)  # [B, Q]: padding repeats the last row
        seen = items.seq_lens.long().unsqueeze(1) - q_len + r + 1  # keys per row
        plan = BlockPlan(
            rows=items.q_starts.long().unsqueeze(1) + r,
            blocks=tables[listed],
            seq_of_block=torch.arange(len(few)).repeat_interleave(num_blocks),
            padded_index=listed.flatten().nonzero().squeeze(1),
            key_mask=torch.arange(width * block_size).view(1, 1, -1) < seen.unsqueeze(2),
            width=width)
    blocks, offsets = slots // block_size, slots % block_size
    heads = torch.arange(kv_heads)
    write_rows = ((blocks.unsqueeze(1) * kv_heads + heads) * block_size
                  + offsets.unsqueeze(1)).flatten()
    return StepPlan(write_rows, items, plan, prefills)


class TorchAttentionBackend(AttentionBackend):
    def write_kv(self, k, v, kv_cache, meta, kv_scale=UNSCALED):
        plan = self._plan(kv_cache, meta, k.dtype)
        head_dim = kv_cache.shape[4]
        cache = storage(kv_cache)
        # Row copies: index_copy_ stays a memcpy per row, where a two-index index_put runs
        # in parallel and stalled for milliseconds when a core was busy (7 us vs 8-8,000 us
        # per call, 32 tokens, two threads).
        for i, x, s in ((0, k, kv_scale.k), (1, v, kv_scale.v)):
            stored = storage(quantize(x, s, kv_cache.dtype))
            cache[i].view(-1, head_dim).index_copy_(0, plan.write_rows,
                                                    stored.reshape(-1, head_dim))

    def attend(self, q, kv_cache, meta, scale, kv_scale=UNSCALED):
        plan = self._plan(kv_cache, meta, q.dtype)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as q may not be
        if plan.items is not None:
            self._attend_items(q, out, kv_cache, meta, plan, scale, kv_scale)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in plan.prefills:
            q_start, q_end, seq_len = starts[i], starts[i + 1], lens[i]
            out[q_start:q_end] = _prefill(q[q_start:q_end], kv_cache, meta.block_tables[i],
                                          seq_len, scale, kv_scale)
        return out

    def _attend_items(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, plan: StepPlan, scale: float,
                      kv_scale: KVScale) -> None:
        """Writes out's rows of plan.items."""
        rows = plan.blockwise.rows
        out[rows] = _blockwise(q[rows], kv_cache, plan.blockwise, scale, kv_scale)

    def _build_plan(self, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    dtype: torch.dtype) -> StepPlan:
        return build_plan(meta, kv_cache.shape[3], kv_cache.shape[2])

    def _plan(self, kv_cache: torch.Tensor, meta: AttentionMetadata,
              dtype: torch.dtype) -> StepPlan:
        """The step's plan, built by its first call; dtype: the model's (q's, k's)."""
        if meta.plan is None:
            meta.plan = self._build_plan(kv_cache, meta, dtype)
        return meta.plan


def _blocks(kv_cache: torch.Tensor, i: int, blocks: torch.Tensor, scale: float,
            dtype: torch.dtype) -> torch.Tensor:
    """Cache blocks of keys (i = 0) or values (1), read as dtype values."""
    return dequantize(kv_cache[i].index_select(0, blocks), scale, dtype)


def _blockwise(q: torch.Tensor, kv_cache: torch.Tensor, plan: BlockPlan,
               scale: float, kv_scale: KVScale) -> torch.Tensor:
    """q: [B, Q, heads, head_dim] (each sequence's query rows) -> the same shape."""
    num_seqs, num_q, num_heads, head_dim = q.shape
    _, _, kv_heads, block_size, _ = kv_cache.shape
    group = num_heads // kv_heads
    rows = num_q * group  # a block's query rows per KV head: (query, head in group)
    k = _blocks(kv_cache, 0, plan.blocks, kv_scale.k, q.dtype)  # [N, kvh, block_size, d]
    v = _blocks(kv_cache, 1, plan.blocks, kv_scale.v, q.dtype)
    q = q.view(num_seqs, num_q, kv_heads, group, head_dim).transpose(1, 2).reshape(
        num_seqs, kv_heads, rows, head_dim)
    scores = torch.matmul(q.index_select(0, plan.seq_of_block), k.transpose(-1, -2))
    padded = scores.new_full((num_seqs * plan.width, kv_heads, rows, block_size),
                             float("-inf"), dtype=torch.float32)
    padded.index_copy_(0, plan.padded_index, scores.float())
    padded = padded.view(num_seqs, plan.width, kv_heads, rows, block_size).permute(
        0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, num_q, group, plan.width * block_size)
    padded.masked_fill_(~plan.key_mask[:, None, :, None, :], float("-inf"))
    probs = (padded * scale).softmax(dim=-1).to(q.dtype)
    probs = probs.view(num_seqs, kv_heads, rows, plan.width, block_size).permute(
        0, 3, 1, 2, 4).reshape(num_seqs * plan.width, kv_heads, rows, block_size)
    partial = torch.matmul(probs.index_select(0, plan.padded_index), v)  # [N, kvh, rows, d]
    out = torch.zeros((num_seqs, kv_heads, rows, head_dim), dtype=torch.float32)
    out.index_add_(0, plan.seq_of_block, partial.float())
    return out.view(num_seqs, kv_heads, num_q, group, head_dim).transpose(1, 2).reshape(
        num_seqs, num_q, num_heads, head_dim).to(q.dtype)


def _prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
             scale: float, kv_scale: KVScale) -> torch.Tensor:
    """q: [q_len, heads, head_dim], the last q_len positions of a seq_len-token context."""
    _, _, kv_heads, block_size, head_dim = kv_cache.shape
    blocks = block_table[:-(-seq_len // block_size)].long()
    k, v = (_blocks(kv_cache, i, blocks, s, q.dtype).transpose(0, 1).reshape(
        kv_heads, -1, head_dim)[None, :, :seq_len]
        for i, s in ((0, kv_scale.k), (1, kv_scale.v)))  # [1, kv_heads, seq_len, head_dim]
    q_len = q.shape[0]
    mask = None
    if q_len < seq_len:
        # Query row r is absolute position (seq_len - q_len + r); it sees keys <= that.
        rows = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        mask = torch.arange(seq_len).unsqueeze(0) <= rows
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
