"""An fp8 (e4m3) KV cache in every attention backend: each writes the same bits as
kv_quant.quantize, and attends as the PyTorch reference does over a float32 cache holding the
dequantized values (so the only difference left is arithmetic order)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from sluice.engine.attention.backend import AttentionMetadata, kv_cache_shape
from sluice.engine.attention.cpu_backend import CpuAttentionBackend
from sluice.engine.attention.kv_quant import (
    FP8,
    FP8_MAX,
    KVScale,
    dequantize,
    kv_cache_dtype,
    quantize,
)
from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.config import CacheConfig

SCALE = KVScale(0.02, 0.5)  # keys at 50x, values at 2x their stored values
# (cached, new) per sequence: a prefill, a prefix hit, decodes, and one long enough for the
# CPU kernel's transposed-key prefill tiles
SEQS = [(0, 21), (37, 13), (45, 1), (18, 1), (0, 1), (5, 40)]


def _step(block_size: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(block_size + head_dim)
    need = [-(-(c + n) // block_size) for c, n in SEQS]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, starts, lens = [], [], [0], []
    for (cached, new), nb in zip(SEQS, need):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
        starts.append(starts[-1] + new)
        lens.append(cached + new)
    width = max(map(len, tables))
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    # The cached prefix: stored values across e4m3's range, subnormals and saturation included.
    stored = (torch.randn(shape, generator=g) * 30).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    tokens = starts[-1]
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=g).to(dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=g) * 0.3).to(dtype)
    v = (torch.randn(tokens, kv_heads, head_dim, generator=g) * 40).to(dtype)  # some saturate
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return q, k, v, stored, meta


def _fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, meta.query_start_loc_cpu, meta.seq_lens_cpu)


def _reference(q, k, v, stored, meta):
    """Quantized writes by kv_quant, then float32 attention over the dequantized cache."""
    cache = stored.clone()
    TorchAttentionBackend().write_kv(k, v, cache, _fresh(meta), SCALE)
    plain = torch.stack([dequantize(cache[0], SCALE.k, torch.float32),
                         dequantize(cache[1], SCALE.v, torch.float32)])
    out = TorchAttentionBackend().attend(q.float(), plain, _fresh(meta), q.shape[-1] ** -0.5)
    return cache, out


def test_quantize_saturates_and_rounds_as_torch():
    x = torch.tensor([1000.0, -1000.0, 0.1, 3e-3, -0.0])
    got = quantize(x, 2.0, FP8).float()
    assert got.tolist()[:2] == [448.0, -448.0]
    assert torch.equal(got[2:], (x[2:] / 2).to(FP8).float())
    assert quantize(x, 2.0, torch.float32) is x  # other caches store x as it is
    assert kv_cache_dtype("fp8", torch.bfloat16) == FP8 == kv_cache_dtype("fp8_e4m3", torch.float32)
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="fp8_e5m2.*auto, fp8, fp8_e4m3"):
        CacheConfig(cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_value_reads_back_as_torch_converts_it(ops, dtype):
    """All 256 codes through the kernel's conversions (bf16 at this shape takes the AVX-512
    BF16 path's table where the CPU has one): four one-token sequences, each attending to a
    single key, return its value row, 64 codes each, times the value scale."""
    codes = torch.arange(256, dtype=torch.uint8)
    cache = torch.zeros(kv_cache_shape(4, 16, 1, 64), dtype=FP8)
    cache.view(torch.uint8)[1, :, 0, 0] = codes.view(4, 64)  # value rows; keys 0
    q = torch.zeros(4, 1, 64, dtype=dtype)
    meta = AttentionMetadata(torch.zeros(4, dtype=torch.long),
                             torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
                             torch.arange(4, dtype=torch.int32).view(4, 1), list(range(5)),
                             [1] * 4)
    out = CpuAttentionBackend(ops).attend(q, cache, meta, 1.0, KVScale(1.0, 3.0))
    got, want = out.float().flatten(), codes.view(FP8).float() * 3.0
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert got[~finite].isnan().all()  # e4m3's two NaN codes stay NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (8, 80)])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_cache_equals_dequantized_reference(ops, backend, dtype, block_size, head_dim):
    q, k, v, stored, meta = _step(block_size, 2, 3, head_dim, dtype)
    ref_cache, ref = _reference(q, k, v, stored, meta)
    impl = CpuAttentionBackend(ops) if backend == "cpu" else TorchAttentionBackend()
    cache = stored.clone()
    impl.write_kv(k, v, cache, meta, SCALE)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    got = impl.attend(q, cache, meta, head_dim ** -0.5, SCALE)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, atol=tol * 40, rtol=tol)


@pytest.mark.slow  # Triton's interpreter on CPU
def test_triton_fp8_cache_equals_dequantized_reference():
    from sluice.engine.attention.triton_backend import TritonAttentionBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, stored, meta = _step(16, 2, 2, 32, torch.float32)
    if device == "cpu":
        # The interpreter's float8 downcast (triton/runtime/interpreter.py, _convert_float)
        # rounds the significand without carrying into the exponent (7.9 -> 4), unlike the
        # GPU's cvt: interpreted writes are checked on values e4m3 holds exactly.
        k = dequantize(quantize(k, SCALE.k, FP8), SCALE.k, torch.float32)
        v = dequantize(quantize(v, SCALE.v, FP8), SCALE.v, torch.float32)
    ref_cache, ref = _reference(q, k, v, stored, meta)
    backend = TritonAttentionBackend()
    dev = AttentionMetadata(*(t.to(device) for t in (meta.slot_mapping, meta.query_start_loc,
                                                    meta.seq_lens, meta.block_tables)),
                            meta.query_start_loc_cpu, meta.seq_lens_cpu)
    cache = stored.to(device)
    backend.write_kv(k.to(device), v.to(device), cache, dev, SCALE)
    assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
    got = backend.attend(q.to(device), cache, dev, 32 ** -0.5, SCALE)
    torch.testing.assert_close(got.cpu(), ref, atol=4e-3, rtol=2e-4)
