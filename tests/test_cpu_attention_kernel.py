"""The CPU paged attention kernel (csrc/paged_attention.c), every ISA variant this CPU runs,
against the PyTorch reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sluice.engine import kernels
from sluice.engine.attention.backend import AttentionMetadata, kv_cache_shape
from sluice.engine.attention.cpu_backend import CpuAttentionBackend
from sluice.engine.attention.torch_backend import TorchAttentionBackend


def _step(gen, lens, q_lens, block_size, kv_heads, group, head_dim, dtype):
    """A step of few-query sequences (and prefill chunks where q_lens has long ones) over
    shuffled block tables with partial last blocks."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim),
                        generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = max(len(t) for t in tables) + 2  # padded tables, as the runner builds them
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return q, cache, meta


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (16, 32), (32, 128), (8, 80)])
def test_kernel_equals_reference(ops, dtype, tol, block_size, head_dim):
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim)
    lens = [1, block_size, block_size + 1, 45, 300, 9, 60, 77, 210]
    # decodes, speculative-style rows, prefill chunks of one tile and of four (64, 64, 64, 8
    # rows after a 10-token cached prefix)
    q_lens = [1, 1, 1, 5, 1, 9, 30, 16, 200]
    q, cache, meta = _step(gen, lens, q_lens, block_size, 2, 3, head_dim, dtype)
    ref = TorchAttentionBackend().attend(q, cache, meta, head_dim ** -0.5)
    meta.plan = None
    got = CpuAttentionBackend(ops).attend(q, cache, meta, head_dim ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_kernel_threads_and_gqa_groups(ops):
    """Several OpenMP threads give the result one thread gives; MHA (group 1) and wide GQA."""
    for kv_heads, group in [(4, 1), (1, 8)]:
        gen = torch.Generator().manual_seed(group)
        q, cache, meta = _step(gen, [50, 200, 3, 129], [1, 4, 1, 2], 16, kv_heads, group, 64,
                               torch.float32)
        backend = CpuAttentionBackend(ops)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = backend.attend(q, cache, meta, 0.125)
            torch.set_num_threads(2)
            two = backend.attend(q, cache, meta, 0.125)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)
        ref = TorchAttentionBackend().attend(q, cache, AttentionMetadata(
            meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.query_start_loc_cpu, meta.seq_lens_cpu), 0.125)
        torch.testing.assert_close(one, ref, atol=1e-5, rtol=1e-5)


def test_kernel_plan_skips_the_blockwise_tensors(ops):
    q, cache, meta = _step(torch.Generator().manual_seed(3), [20, 40], [1, 1], 16, 2, 2, 64,
                           torch.bfloat16)
    CpuAttentionBackend(ops).attend(q, cache, meta, 0.125)
    assert meta.plan.blockwise is None and meta.plan.items.seq_lens.tolist() == [20, 40]
    # float16 is not a kernel dtype: the same backend takes the PyTorch blockwise path.
    meta.plan = None
    CpuAttentionBackend(ops).attend(q.half(), cache.half(), meta, 0.125)
    assert meta.plan.blockwise is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_scores_stay_finite_and_nan_propagates(ops, dtype):
    """Scores far apart (one key dominating by ~1e4) underflow the rest to 0 without NaN or
    inf; a NaN in the cache shows in the output instead of being masked away (bf16 at this
    shape takes the AVX-512 BF16 path where the CPU has one)."""
    gen = torch.Generator().manual_seed(4)
    q, cache, meta = _step(gen, [40], [1], 16, 1, 1, 64, dtype)
    table = meta.block_tables[0].tolist()
    cache[0, table[1], 0, 3] = q[0, 0] * 300  # key 19 scores ~1e4 above the rest
    out = CpuAttentionBackend(ops).attend(q, cache, meta, 1.0)
    torch.testing.assert_close(out[0, 0], cache[1, table[1], 0, 3])
    cache[1, table[2], 0, 0, 0] = float("nan")
    meta.plan = None
    assert CpuAttentionBackend(ops).attend(q, cache, meta, 1.0).isnan().any()


def test_without_the_kernels_the_engine_keeps_the_pytorch_path(monkeypatch):
    """An install built without torch has no sluice.engine._C: kernels.ops() is None, the engine
    builds the PyTorch backend, and `--attention-backend cpu` refuses to start."""
    from sluice.engine.model_setup import cpu_backend

    kernels.ops.cache_clear()
    monkeypatch.setitem(sys.modules, "sluice.engine._C", None)  # import raises ImportError
    try:
        assert kernels.ops() is None
        assert type(cpu_backend(required=False)) is TorchAttentionBackend
        with pytest.raises(RuntimeError, match="not installed"):
            cpu_backend(required=True)
    finally:
        kernels.ops.cache_clear()
    monkeypatch.undo()
    assert kernels.ops() is not None


@pytest.mark.parametrize("isa, selected", [("portable", "portable"), ("sse9", None)])
def test_the_environment_forces_a_variant(isa, selected):
    """SLUICE_CPU_ISA: the portable path on any machine (CI forces it through the tests
    above too); a variant not built is an error naming those that are."""
    code = ("from sluice.engine import kernels; import torch; kernels.ops(); "
            "print(torch.ops.sluice.cpu_isa())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, kernels.ISA_ENV: isa}, timeout=120, check=False)
    if selected is None:
        assert run.returncode != 0 and "no CPU kernel variant sse9 (built: portable" in \
            run.stderr, run.stderr
    else:
        assert run.returncode == 0 and run.stdout.split() == [selected], run.stderr


def test_bad_calls_are_errors_not_reads_out_of_bounds(ops):
    q = torch.zeros(2, 4, 64)
    cache = torch.zeros(kv_cache_shape(4, 16, 2, 64))
    table = torch.zeros(1, 4, dtype=torch.int32)
    ints = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]
    with pytest.raises(RuntimeError, match="out: q's dtype"):
        ops.paged_attention(q, q.bfloat16(), cache[0], cache[1], table, *ints, 1.0)
    with pytest.raises(RuntimeError, match="q's dtype or float8"):
        ops.paged_attention(q, q.clone(), cache[0].bfloat16(), cache[1].bfloat16(), table,
                            *ints, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.paged_attention(q, q.clone(), cache[0].to(torch.float8_e4m3fn), cache[1], table,
                            *ints, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_attention(q, q.clone(), cache[0], cache[1], table, ints[0], ints[1],
                            ints[2], torch.zeros(2, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.zeros(2, 64).bfloat16(), torch.zeros(32).bfloat16(), 1e-5)
