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

import pytest
from triton_aot import run_aot_script

from sluice.engine.attention.backend import AttentionMetadata, kv_cache_shape
from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.attention.triton_backend import TritonAttentionBackend

pytestmark = pytest.mark.slow  # on CPU every kernel runs in Triton's interpreter

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32]
TOL = {torch.float32: 2e-4 if not CUDA else 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
REF = TorchAttentionBackend()


def make_step(seqs, num_kv_heads, qpk, head_dim, block_size, dtype, seed, pad_tokens=0,
              pad_seqs=0, pad_decodes=0):
    """A step over `seqs` = [(cached_len, new_len)]: random cache (garbage everywhere, so a
    read past the context shows), shuffled block tables, this step's slots, random q/k/v.
    CUDA-graph style padding after the real sequences: pad_decodes sequences of query length 1
    and seq_len 0, pad_seqs of query length 0, pad_tokens tokens past query_start_loc[-1];
    padded tokens have slot -1."""
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
    slots += [-1] * (pad_decodes + pad_tokens)
    qsl += [qsl[-1] + i + 1 for i in range(pad_decodes)]
    qsl += [qsl[-1]] * pad_seqs
    lens += [0] * pad_decodes + [1] * pad_seqs
    tables += [[]] * (pad_decodes + pad_seqs)
    width = max(len(t) for t in tables) + 1  # one extra padded column
    padded = [t + [0] * (width - len(t)) for t in tables]
    tokens = qsl[-1] + pad_tokens
    heads = num_kv_heads * qpk
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g)
    q = torch.randn((tokens, heads, head_dim), generator=g)
    k = torch.randn((tokens, num_kv_heads, head_dim), generator=g)
    v = torch.randn((tokens, num_kv_heads, head_dim), generator=g)

    def meta(device):
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens)

    # Rounding everything through `dtype` first makes kernel and reference see equal inputs.
    rd = [t.to(dtype).float() for t in (cache, q, k, v)]
    return rd, meta


def check_attention(backend, seqs, num_kv_heads, qpk, head_dim, block_size, dtype, seed,
                    pad_tokens=0, pad_seqs=0, pad_decodes=0):
    (cache, q, k, v), meta = make_step(seqs, num_kv_heads, qpk, head_dim, block_size, dtype,
                                       seed, pad_tokens, pad_seqs, pad_decodes)
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
    assert torch.equal(got[real:real + pad_decodes].cpu(), q[real:real + pad_decodes].mul(0))


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
    """Splits also apply to a short prefill chunk over a long cached prefix (causal rows).
    In (100, 30) the last query block covers positions 124..129 and split 2 starts at key 128,
    so rows 124..127 see no key in that split (lse = -inf, must not turn into NaN)."""
    backend = TritonAttentionBackend(max_num_splits=4, target_programs=10**6)
    check_attention(backend, [(250, 9), (40, 1)], 1, 2, 64, 16, dtype, seed=7)
    check_attention(backend, [(100, 30)], 1, 2, 64, 16, dtype, seed=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_batch_path(dtype):
    """The wide-batch configuration (64-row programs, 64-key tiles, no split)."""
    backend = TritonAttentionBackend(max_split_tokens=0)
    check_attention(backend, [(0, 70), (33, 40), (90, 1), (7, 1)], 1, 4, 64, 16, dtype, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_graph_padding(splits, dtype):
    """Padded tokens (slot -1) and padded sequences (query length 0, or query length 1 with
    seq_len 0, whose output is 0) leave the real rows exact."""
    backend = TritonAttentionBackend(max_num_splits=splits, target_programs=10**6)
    check_attention(backend, [(50, 1), (0, 1), (77, 1)], 1, 2, 64, 32, dtype, seed=11,
                    pad_tokens=5, pad_seqs=3, pad_decodes=3)


# Triton 3.8's interpreter computes tl.dot on bfloat16 operands wrongly (triton#11584: raw
# bit patterns multiplied), so on CPU float16 exercises the 16-bit path (P cast to V's dtype).
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if CUDA else [torch.float16])
def test_half_precision(dtype):
    check_attention(TritonAttentionBackend(), MIXED, 1, 4, 64, 16, dtype, seed=21)
    check_attention(TritonAttentionBackend(max_num_splits=4, target_programs=10**6),
                    [(100, 30), (50, 1)], 1, 4, 64, 16, dtype, seed=22)

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
    got = cache.to(DEVICE, dtype, copy=True)
    TritonAttentionBackend().write_kv(k_view, v_view, got, m)
    expected = cache.to(dtype, copy=True)
    assert got.data_ptr() != expected.data_ptr()
    keep = m.slot_mapping.cpu() >= 0
    ref_meta = meta("cpu")
    ref_meta.slot_mapping = ref_meta.slot_mapping[keep]
    TorchAttentionBackend().write_kv(k[keep].to(dtype), v[keep].to(dtype), expected, ref_meta)
    assert torch.equal(got.cpu(), expected)



@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_matches_torch_backend(family, tmp_path):
    """The whole engine (decoder, chunked prefill, prefix-cache hits, decodes with split-KV)
    gives the same greedy tokens with this backend as with the PyTorch one (float32)."""
    import json

    from hf_models import tiny_config

    from sluice.engine import llm_engine
    from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from sluice.engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(tiny_config(family)))
    rnd = random.Random(0)
    shared = [rnd.randrange(3, 512) for _ in range(26)]
    first = [shared + [rnd.randrange(3, 512) for _ in range(5)]]
    rest = [shared + [rnd.randrange(3, 512) for _ in range(n)] for n in (2, 9)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def generate(backend):
        engine = llm_engine.LLMEngine(EngineConfig(
            model=str(tmp_path), served_model_name="tiny", load_format="dummy",
            dtype="float32", device=DEVICE.type, attention_backend=backend, enforce_eager=True,
            cache=CacheConfig(block_size=8, num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=24)))
        out = engine.generate(first, greedy) + engine.generate(rest, greedy)
        assert engine.metrics.prefix_hits._value.get() >= 2 * 24
        return out

    assert generate("triton") == generate("torch")

# Compiled (not interpreted) for an H100 without one: the interpreter accepts code that the
# compiler may reject, and says nothing about registers. Each case is what `plan` picks for a
# real shape; the PTX goes through Triton's bundled ptxas, which must report no spills.
_AOT_SCRIPT = r"""
import os, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sluice.engine.attention import triton_kernels as K
from sluice.engine.attention.triton_backend import TritonAttentionBackend

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
         torch.float8_e4m3fn: "fp8e4nv"}
TARGET = GPUTarget("cuda", 90, 32)


def compile_checked(fn, types, consts, num_warps, label):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # What the launcher specialises for these shapes: 16-aligned pointers and strides.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (n.endswith("_ptr") or n.startswith("stride"))}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                            options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    info = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                          capture_output=True, text=True, check=True).stderr
    assert "0 bytes spill stores" in info, (label, info)
    assert kernel.metadata.shared <= 232448, (label, kernel.metadata.shared)  # sm_90 opt-in max
    print("ok", label, flush=True)


backend = TritonAttentionBackend(target_programs=264)  # 2 x 132 SMs
cuda = torch.device("cuda")
FP8 = torch.float8_e4m3fn
# (label, num_tokens, num_seqs, heads, kv_heads, head_dim, block_size, dtype[, cache dtype])
for label, t, s, h, kvh, d, bs, dt, *kv in [
    ("llama8b decode b1", 1, 1, 32, 8, 128, 16, torch.bfloat16),
    ("llama8b decode b1 fp8 kv", 1, 1, 32, 8, 128, 16, torch.bfloat16, FP8),
    ("llama8b prefill 2048 fp8 kv", 2048, 1, 32, 8, 128, 16, torch.bfloat16, FP8),
    ("llama8b prefill 2048", 2048, 1, 32, 8, 128, 16, torch.bfloat16),
    ("qwen3-0.6b decode b64", 64, 64, 16, 8, 128, 16, torch.bfloat16),
    ("llama1b decode b1 fp16", 1, 1, 32, 8, 64, 32, torch.float16),
    ("mha prefill bs32", 512, 2, 16, 16, 128, 32, torch.bfloat16),
    ("head_dim 256 prefill", 1024, 2, 8, 4, 256, 16, torch.bfloat16),
    ("head_dim 256 decode b2", 2, 2, 8, 4, 256, 16, torch.bfloat16),
    ("gqa8 decode fp32", 4, 4, 32, 4, 128, 16, torch.float32),
    ("gqa4 prefill fp32", 1024, 1, 32, 8, 128, 16, torch.float32),
]:
    lp = backend.plan(t, s, h, kvh, d, bs, dt, cuda)
    name, cache = NAMES[dt], NAMES[kv[0] if kv else dt]
    scales = {"k_scale": "fp32", "v_scale": "fp32"}
    types = {"q_ptr": "*" + name, "cache_ptr": "*" + cache, "out_ptr": "*" + name,
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32",
             "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "scale_log2": "fp32", **scales}
    compile_checked(K.paged_attention_kernel, types, {**lp.constexprs, "FP8": bool(kv)},
                    lp.num_warps, f"{label} splits={lp.num_splits}")
    if lp.num_splits > 1:
        compile_checked(K.split_kv_reduce_kernel,
                        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*" + name},
                        dict(HEAD_DIM=d, HEAD_DIM_P2=d, NUM_SPLITS=lp.num_splits), 4,
                        label + " reduce")
    compile_checked(K.write_kv_kernel,
                    {"k_ptr": "*" + name, "v_ptr": "*" + name, "cache_ptr": "*" + cache,
                     "slot_ptr": "*i64", **scales},
                    dict(NUM_KV_HEADS=kvh, HEADS_P2=triton.next_power_of_2(kvh), HEAD_DIM=d,
                         HEAD_DIM_P2=d, BLOCK_SIZE=bs, FP8=bool(kv)), 4, label + " write")
"""


@pytest.mark.skipif(CUDA, reason="on a GPU the tests above run the compiled kernels")
def test_compiles_for_sm90(tmp_path):
    """The kernels compile for sm_90 as `plan` configures them, without register spills."""
    res = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
