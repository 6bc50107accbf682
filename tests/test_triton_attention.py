"""Triton paged attention and KV write against the PyTorch reference (TorchAttentionBackend).

On a CUDA machine the kernels run compiled in bf16/fp16/fp32; without one they run through
Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported) in fp32 on
small shapes. The reference always runs on CPU in fp32 over the same cache contents.
"""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from sluice.engine.attention.backend import AttentionMetadata  # noqa: E402
from sluice.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from sluice.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32]
TOL = {torch.float32: 2e-4 if not CUDA else 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
REF = TorchAttentionBackend()


def make_step(seqs, num_kv_heads, qpk, head_dim, block_size, dtype, seed, pad_tokens=0,
              pad_seqs=0):
    """A step over `seqs` = [(cached_len, new_len)]: random cache (garbage everywhere, so a
    read past the context shows), shuffled block tables, this step's slots, random q/k/v.
    pad_tokens / pad_seqs add CUDA-graph style padding (slot -1, query length 0)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, qsl, lens = [], [], [0], []
    for (cached, new), nb in zip(seqs, need):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
        qsl.append(qsl[-1] + new)
        lens.append(cached + new)
    slots += [-1] * pad_tokens
    qsl += [qsl[-1]] * pad_seqs
    lens += [1] * pad_seqs
    tables += [[]] * pad_seqs
    width = max(len(t) for t in tables) + 1  # one extra padded column
    padded = [t + [0] * (width - len(t)) for t in tables]
    tokens = qsl[-1] + pad_tokens
    heads = num_kv_heads * qpk
    cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=g)
    q = torch.randn((tokens, heads, head_dim), generator=g)
    k = torch.randn((tokens, num_kv_heads, head_dim), generator=g)
    v = torch.randn((tokens, num_kv_heads, head_dim), generator=g)

    def meta(device):
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])), max_seq_len=max(lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens)

    # Rounding everything through `dtype` first makes kernel and reference see equal inputs.
    rd = [t.to(dtype).float() for t in (cache, q, k, v)]
    return rd, meta


def check_attention(backend, seqs, num_kv_heads, qpk, head_dim, block_size, dtype, seed,
                    pad_tokens=0, pad_seqs=0):
    (cache, q, k, v), meta = make_step(seqs, num_kv_heads, qpk, head_dim, block_size, dtype,
                                       seed, pad_tokens, pad_seqs)
    real = sum(n for _, n in seqs)
    ref_meta = meta("cpu")
    ref_meta.slot_mapping = ref_meta.slot_mapping[:real]
    ref_meta.query_start_loc_cpu = ref_meta.query_start_loc_cpu[:len(seqs) + 1]
    ref_meta.seq_lens_cpu = ref_meta.seq_lens_cpu[:len(seqs)]
    REF.write_kv(k[:real], v[:real], cache, ref_meta)
    scale = head_dim ** -0.5
    expected = REF.attend(q[:real], cache, ref_meta, scale)

    dev_cache = cache.to(DEVICE, dtype)
    got = backend.attend(q.to(DEVICE, dtype), dev_cache, meta(DEVICE), scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got[:real].float().cpu(), expected, atol=TOL[dtype],
                               rtol=TOL[dtype])


MIXED = [(0, 21), (37, 13), (45, 1), (18, 1), (0, 1), (16, 1)]  # prefill, prefix hit, decodes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("qpk", [1, 2, 4, 8])
def test_mixed_batch(qpk, head_dim, block_size, dtype):
    """Prefill chunk from scratch, prefix hit (cached + new chunk), decodes incl. seq_len 1 and
    a context ending exactly on a block boundary, in one launch."""
    check_attention(TritonAttentionBackend(), MIXED, 2 if qpk <= 2 else 1, qpk, head_dim,
                    block_size, dtype, seed=qpk * 1000 + head_dim + block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qpk,block_size", [(1, 16), (4, 32), (8, 16)])
def test_split_kv_long_context(qpk, block_size, dtype):
    """Batch-1 decode over a long context, and a small batch of decodes, cut into 8 splits
    (some empty for the short sequence)."""
    backend = TritonAttentionBackend(max_num_splits=8, target_programs=10**6)
    assert backend._num_splits(1, True, DEVICE) == 8
    check_attention(backend, [(389, 1)], 1, qpk, 64, block_size, dtype, seed=qpk)
    check_attention(backend, [(300, 1), (3, 1), (170, 1)], 2, qpk, 64, block_size, dtype,
                    seed=qpk + 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_prefix_chunk(dtype):
    """Splits also apply to a short prefill chunk over a long cached prefix (causal rows)."""
    backend = TritonAttentionBackend(max_num_splits=4, target_programs=10**6)
    check_attention(backend, [(250, 9), (40, 1)], 1, 2, 64, 16, dtype, seed=7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_batch_path(dtype):
    """The wide-batch configuration (64-row programs, 64-key tiles, no split)."""
    backend = TritonAttentionBackend(max_split_tokens=0)
    check_attention(backend, [(0, 70), (33, 40), (90, 1), (7, 1)], 1, 4, 64, 16, dtype, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_graph_padding(splits, dtype):
    """Padded tokens (slot -1) and padded sequences (query length 0) leave real rows exact."""
    backend = TritonAttentionBackend(max_num_splits=splits, target_programs=10**6)
    check_attention(backend, [(50, 1), (0, 1), (77, 1)], 1, 2, 64, 32, dtype, seed=11,
                    pad_tokens=5, pad_seqs=5)


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes(seed):
    """Random batches, GQA ratios 1-8 (also non powers of two), head dims incl. 16 and a
    padded 96, split counts and program targets."""
    rnd = random.Random(seed)
    qpk = rnd.randint(1, 8)
    head_dim = rnd.choice([16, 32, 64, 96, 128])
    block_size = rnd.choice([16, 32])
    seqs = [(rnd.choice([0, rnd.randrange(1, 120)]), rnd.choice([1, 1, rnd.randrange(1, 40)]))
            for _ in range(rnd.randrange(1, 5))]
    backend = TritonAttentionBackend(max_num_splits=rnd.choice([1, 2, 8]),
                                     target_programs=rnd.choice([1, 64, 10**6]))
    check_attention(backend, seqs, rnd.choice([1, 2]), qpk, head_dim, block_size, DTYPES[-1 if
                    seed % 2 else 0], seed=100 + seed)


def test_noncontiguous_q():
    """q as a strided view of a fused qkv projection (what the decoder passes)."""
    (cache, q, k, v), meta = make_step([(20, 5), (9, 1)], 2, 2, 64, 16, torch.float32, seed=5)
    REF.write_kv(k, v, cache, meta("cpu"))
    fused = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 64)], dim=1)
    q_view = fused[:, :q[0].numel()].view(q.shape)
    assert not q_view.is_contiguous()
    expected = REF.attend(q, cache, meta("cpu"), 0.125)
    got = TritonAttentionBackend().attend(q_view.to(DEVICE), cache.to(DEVICE), meta(DEVICE),
                                          0.125)
    torch.testing.assert_close(got.cpu(), expected, atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 128, 32),
                                                              (8, 64, 16)])
def test_write_kv(num_kv_heads, head_dim, block_size, dtype):
    """Each token's K/V land in its slot; slots < 0 and every other slot stay untouched;
    k/v may be strided views (as split out of a fused qkv projection)."""
    (cache, _, k, v), meta = make_step([(5, 7), (0, 1), (31, 2)], num_kv_heads, 1, head_dim,
                                       block_size, dtype, seed=num_kv_heads, pad_tokens=3)
    m = meta(DEVICE)
    m.slot_mapping[3] = -1  # a skipped real token too
    kv = torch.cat([k, v], dim=1).to(DEVICE, dtype)
    k_view, v_view = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    got = cache.to(DEVICE, dtype)
    TritonAttentionBackend().write_kv(k_view, v_view, got, m)
    expected = cache.to(dtype)
    keep = m.slot_mapping.cpu() >= 0
    ref_meta = meta("cpu")
    ref_meta.slot_mapping = ref_meta.slot_mapping[keep]
    TorchAttentionBackend().write_kv(k[keep].to(dtype), v[keep].to(dtype), expected, ref_meta)
    assert torch.equal(got.cpu(), expected)
