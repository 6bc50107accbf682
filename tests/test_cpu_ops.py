"""The kernels' RMSNorm and rotary (csrc/norm_rotary.c), every ISA variant this CPU runs,
against the PyTorch ops they stand in for, and the layers choosing them where they apply."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.layers.layernorm import RMSNorm
from sluice.engine.layers.rotary_embedding import RotaryEmbedding
from sluice.engine.loader import load_model


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Torch threads: from 64 rows on, the kernels split their rows over them."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_and_rotary_equal_pytorch(ops, tokens, threads):
    """Rotary bit for bit; RMSNorm too except where its sum of squares, added in another
    order, lands a rounding the other way: one bf16 step, rarely."""
    gen = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    norm = norm.bfloat16()
    x = (torch.randn(tokens, 576, generator=gen) * 3).bfloat16()
    got, ref = ops.rms_norm(x, norm.weight, norm.eps).float(), norm.forward_native(x).float()
    torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=0)
    assert (got != ref).float().mean() < 0.005
    # rotary on views into a fused qkv row, at scattered positions (llama3 scaling)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cos, sin = RotaryEmbedding(64, 500000.0, scaling).cos_sin(
        torch.randint(0, 4000, (tokens,), generator=gen), torch.bfloat16)
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64, generator=gen).bfloat16()
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    ref = RotaryEmbedding.apply_native((cos, sin), q, k)
    assert torch.equal(ops.rotary(q, cos, sin), ref[0])
    assert torch.equal(ops.rotary(k, cos, sin), ref[1])


def _kernels_run(fn) -> set[str]:
    """The sluice kernels `fn()` ran (by the profiler's op names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("sluice::")}


def test_the_layers_take_the_kernels_only_where_they_apply(ops):
    norm = RMSNorm(64, 1e-6).bfloat16()
    rows = torch.randn(5, 64).bfloat16()
    assert _kernels_run(lambda: norm(rows)) == {"sluice::rms_norm"}
    per_head = torch.randn(5, 4, 64).bfloat16()  # Qwen3's q/k norms: 3-D
    strided = torch.randn(5, 128).bfloat16()[:, ::2]  # elements not contiguous
    exact = RMSNorm(64, 1e-6)  # float32: the exactness reference
    for layer, x in ((norm, per_head), (norm, strided), (exact, torch.randn(5, 64))):
        assert _kernels_run(lambda layer=layer, x=x: layer(x)) == set()
        assert torch.equal(layer(x), layer.forward_native(x))
    cos_sin = RotaryEmbedding(64, 10000.0, {}).cos_sin(torch.arange(5), torch.bfloat16)
    q, k = torch.randn(5, 4, 64).bfloat16(), torch.randn(5, 2, 64).bfloat16()
    assert _kernels_run(lambda: RotaryEmbedding.apply(cos_sin, q, k)) == {"sluice::rotary"}
    f32 = RotaryEmbedding(64, 10000.0, {}).cos_sin(torch.arange(5), torch.float32)
    assert _kernels_run(lambda: RotaryEmbedding.apply(f32, q.float(), k.float())) == set()


def test_loaded_bf16_models_run_the_kernels_and_float32_does_not(ops, tiny_models):
    for dtype, wanted in ((torch.bfloat16, {"sluice::rms_norm"}), (torch.float32, set())):
        lm = load_model(str(tiny_models["qwen3"]), "auto", TorchAttentionBackend(), dtype,
                        torch.device("cpu"), 0)
        hidden = torch.randn(3, lm.model.norm.weight.shape[0]).to(dtype)
        assert _kernels_run(lambda m=lm, h=hidden: m.model.norm(h)) == wanted
