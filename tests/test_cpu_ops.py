"""The kernels' RMSNorm and rotary (csrc/norm_rotary.c), every ISA variant this CPU runs,
against the PyTorch modules they replace."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.loader import load_model
from sluice.engine.model import cpu_ops
from sluice.engine.model.layers import RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_and_rotary_equal_pytorch(ops, tokens):
    """Rotary bit for bit; RMSNorm too except where its sum of squares, added in another
    order, lands a rounding the other way: one bf16 step, rarely."""
    gen = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    norm = norm.bfloat16()
    x = (torch.randn(tokens, 576, generator=gen) * 3).bfloat16()
    got, ref = cpu_ops.NativeRMSNorm(norm, ops)(x).float(), norm(x).float()
    torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=0)
    assert (got != ref).float().mean() < 0.005
    # rotary on views into a fused qkv row, at scattered positions (llama3 scaling)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cos_sin = RotaryEmbedding(64, 500000.0, scaling).cos_sin(
        torch.randint(0, 4000, (tokens,), generator=gen), torch.bfloat16)
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64, generator=gen).bfloat16()
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    got, ref = cpu_ops.native_rotary(ops, cos_sin, q, k), RotaryEmbedding.apply(cos_sin, q, k)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_norm_falls_back_where_the_c_op_does_not_apply(ops):
    norm = RMSNorm(64, 1e-6).bfloat16()
    native = cpu_ops.NativeRMSNorm(norm, ops)
    per_head = torch.randn(5, 4, 64).bfloat16()  # Qwen3's q/k norms: 3-D
    strided = torch.randn(5, 128).bfloat16()[:, ::2]  # elements not contiguous
    for x in (per_head, strided, torch.randn(5, 64)):
        assert torch.equal(native(x), norm(x))


def test_loaded_bf16_models_use_the_c_ops_and_float32_keeps_pytorch(ops, tiny_models):
    swapped = load_model(str(tiny_models["qwen3"]), "auto", TorchAttentionBackend(),
                         torch.bfloat16, torch.device("cpu"), 0)
    assert isinstance(swapped.model.norm, cpu_ops.NativeRMSNorm)
    attn = swapped.model.layers[0].self_attn
    assert attn.apply_rotary is not RotaryEmbedding.apply
    assert isinstance(attn.q_norm, cpu_ops.NativeRMSNorm)  # falls back per call: 3-D input
    exact = load_model(str(tiny_models["qwen3"]), "auto", TorchAttentionBackend(),
                       torch.float32, torch.device("cpu"), 0)
    assert type(exact.model.norm) is RMSNorm
    assert exact.model.layers[0].self_attn.apply_rotary is RotaryEmbedding.apply
