"""Triton kernels for the paged KV cache: the KV write, paged attention, and the split-KV reduce.

Layouts (all row-major, last dimension contiguous):
  q, out        [num_tokens, num_heads, head_dim]          flat varlen batch
  k, v          [num_tokens, num_kv_heads, head_dim]
  kv_cache      [2, num_blocks, num_kv_heads, block_size, head_dim]   (0 = K, 1 = V)
  part_out      [num_tokens, num_heads, num_splits, head_dim] fp32  (split-KV partials)
  part_lse      [num_tokens, num_heads, num_splits]           fp32  (log2-sum-exp2 per split)

The cache holds q's dtype, or fp8 e4m3 (kv_quant.py): written as x / scale, saturated, and
read as value x scale (k_scale, v_scale), converted once per tile.

Metadata read on the device: `slot_mapping` (write kernel); `query_start_loc`, `seq_lens`,
`block_tables` (attention kernel). The host-side `*_cpu` lists are never read, so every launch depends only on tensor shapes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program per token: copy its K and V (all KV heads) into slot `slot_mapping[token]`.

    slot = block * BLOCK_SIZE + offset. A negative slot (padding of a CUDA-graph batch) writes
    nothing. Grid: (num_tokens,).
    """
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, HEAD_DIM_P2)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)
    blk = safe_slot // BLOCK_SIZE
    off = safe_slot % BLOCK_SIZE
    dst = cache_ptr + blk * stride_c_blk + off * stride_c_off \
        + heads[:, None] * stride_c_head + dims[None, :]
    k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block `q_block`.

    Sequence i owns the global query blocks [cu(i), cu(i+1)) where
    cu(i) = query_start_loc[i] // BLOCK_Q + i; cu(i+1) - cu(i) >= cdiv(q_len_i, BLOCK_Q), and
    cu(num_seqs) <= num_tokens // BLOCK_Q + num_seqs, the grid size. Binary search for the last
    i with cu(i) <= q_block (cu(0) = 0, so the result is >= 0).
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        cu = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if cu <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_head,
    stride_bt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    QPK: tl.constexpr, QPK_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """Causal paged attention over a flat varlen batch of prefill chunks and decodes.

    Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads, NUM_SPLITS). Program (b, g, s) serves
    query block b: up to BLOCK_Q consecutive query tokens of one sequence times the QPK query
    heads of KV head g (GQA), i.e. a [BLOCK_Q * QPK_P2, head_dim] tile of rows, so each K/V
    tile is loaded once for the whole group. Row r is token r // QPK_P2, head g*QPK + r % QPK_P2.

    Query token t (0-based within this step's chunk of its sequence) is at absolute position
    ctx + t, ctx = seq_len - q_len, and attends keys [0, ctx + t]. The keys the block needs,
    [0, kv_len), are cut into TILE_N-key tiles; split s takes a contiguous run of
    cdiv(num_tiles, NUM_SPLITS) tiles (flash-decoding), so one long sequence spreads over
    NUM_SPLITS programs per KV head.

    NUM_SPLITS == 1: writes the normalised output to out_ptr. Otherwise writes this split's
    normalised partial output and its log2-sum-exp2 (-inf when the split saw no key) to
    part_out/part_lse for `split_kv_reduce_kernel`.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_P2
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return  # spare program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = local_block * BLOCK_Q + rows // QPK_P2  # token index within the sequence's chunk
    head = kv_head * QPK + rows % QPK_P2
    row_ok = (tok < q_len) & (rows % QPK_P2 < QPK)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = ctx + tok

    last_tok = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = ctx + last_tok + 1
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    # Online softmax in the log2 domain: m = running max of scaled scores, l = running sum of
    # exp2(score - m), acc = running sum of exp2(score - m) * V; rescaled by exp2(m_old - m_new).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cache_head = cache_ptr + kv_head * stride_c_head
    for tile in range(tile_begin, tile_end):
        kpos = tile * TILE_N + tl.arange(0, TILE_N)
        k_ok = kpos < kv_len
        blk = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_off = blk * stride_c_blk + (kpos % BLOCK_SIZE) * stride_c_off
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_head + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(cache_head + stride_c_kv + kv_off[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0)
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where((kpos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = q_row * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + dims[None, :], o, mask=store_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + q_row * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def split_kv_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Merge the split-KV partials of one (token, head): out = sum_s w_s o_s / sum_s w_s with
    w_s = exp2(lse_s - max_s lse_s). Splits that saw no key have lse = -inf, weight 0; a row with
    no key at all (padding) gets 0. Grid: (num_tokens, num_heads); rows that the attention
    kernel never wrote (tokens past query_start_loc[-1]) produce unspecified values.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(part_lse_ptr + t * stride_lt + h * stride_lh + splits)
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)))
    base = t * stride_pt + h * stride_ph
    o = tl.load(part_out_ptr + base + splits[:, None] * stride_ps + dims[None, :],
                mask=dim_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims,
             res.to(out_ptr.dtype.element_ty), mask=dim_ok)
