"""The W8A8 float8 matmul (layers/fp8_scaled_mm.py) against its dequantized inputs multiplied
in float32: per-token x per-channel scales and 128-group x 128x128-block scales, ragged
shapes, bias. On CPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from triton_aot import run_aot_script

from sluice.engine.layers.fp8_scaled_mm import FP8, GROUP, quantize_per_token, scaled_mm

pytestmark = pytest.mark.slow  # Triton's interpreter on CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n: int, k: int, group: int, gen: torch.Generator):
    """e4m3 weights [n, k] and scales: per channel [n], or per 128 x 128 block."""
    w = torch.randn(n, k, generator=gen) * 0.05
    if not group:
        scale = w.abs().amax(dim=1) / 448
        return (w / scale[:, None]).to(FP8), scale
    nb, kb = -(-n // group), -(-k // group)
    scale = torch.rand(nb, kb, generator=gen) * 1e-3 + 1e-4
    full = scale.repeat_interleave(group, 0)[:n].repeat_interleave(group, 1)[:, :k]
    return (w / full).clamp(-448, 448).to(FP8), scale


def _dequantized(q: torch.Tensor, scale: torch.Tensor, group: int, rows: bool) -> torch.Tensor:
    if not group:
        return q.float() * scale.view(-1, 1)  # a row (token, or output channel) each
    full = scale.repeat_interleave(group, 1)[:, :q.shape[1]]
    if not rows:  # block scales: repeat over the block's rows too
        full = scale.repeat_interleave(group, 0)[:q.shape[0]].repeat_interleave(
            group, 1)[:, :q.shape[1]]
    return q.float() * full


def test_per_token_quantization_maps_each_rows_max_to_448():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_per_token(x)
    assert q.float()[0].tolist() == [224.0, -448.0, 112.0, 0.0]
    assert s[0].item() == pytest.approx(2 / 448)
    assert q.float()[1].abs().sum() == 0  # an all-zero row: a tiny scale, zeros
    qg, sg = quantize_per_token(torch.arange(256.0).view(1, 256), group=128)
    assert sg.shape == (1, 2) and sg[0].tolist() == pytest.approx([127 / 448, 255 / 448])
    assert qg.float()[0, 127] == 448 and qg.float()[0, 255] == 448


@pytest.mark.parametrize("m, n, k, group", [
    (1, 96, 256, 0), (5, 200, 384, 0), (33, 64, 320, 0),  # per-channel, K ragged last
    (1, 96, 256, GROUP), (5, 200, 384, GROUP), (33, 300, 384, GROUP),  # 128-blocks
])
def test_scaled_mm_equals_the_dequantized_product(m, n, k, group):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + group)
    x = torch.randn(m, k, generator=gen)
    a, a_scale = quantize_per_token(x, group)
    w, w_scale = _weight(n, k, group, gen)
    bias = torch.randn(n, generator=gen)
    want = _dequantized(a, a_scale, group, True) @ _dequantized(w, w_scale, group, False).T
    want += bias
    got = scaled_mm(a.to(DEVICE), a_scale.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE),
                    torch.float32, bias.to(DEVICE), group)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # the product approximates x W^T within the two e4m3 roundings
    exact = x @ _dequantized(w, w_scale, group, False).T + bias
    assert (got.cpu() - exact).abs().max() <= 0.1 * exact.abs().max()


_AOT_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sluice.engine.layers import fp8_scaled_mm as K

fn = K._scaled_mm_kernel
types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
         "b_scale_ptr": "*fp32", "bias_ptr": "*bf16"}
for group in (0, K.GROUP):
    for block_m in (16, 64):  # scaled_mm's two row tiles
        consts = dict(HAS_BIAS=True, GROUP_K=group, BLOCK_M=block_m, BLOCK_N=64,
                      BLOCK_K=group or 64)
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4})
        assert "cvt" in kernel.asm["ptx"] or "mma" in kernel.asm["ptx"], "no PTX"
        print("ok", group, block_m, flush=True)
"""


def test_compiles_for_sm90(tmp_path):
    """The kernel as scaled_mm launches it compiles for sm_90 (fp8 tensor-core dots)."""
    res = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert res.returncode == 0 and res.stdout.count("ok") == 4, res.stdout + res.stderr
