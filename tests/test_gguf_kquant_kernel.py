"""The K-quant kernels (csrc/gguf_k.c: Q4_K, Q5_K, Q6_K), on every instruction-set variant
this CPU runs, against the gguf package's dequantize of random valid blocks
(tests/gguf_blocks.py):
- `gguf_dequantize` is the package's float32 values exactly;
- above four rows `gguf_linear` is torch's matmul of those values exactly, per tile of
  2,048 output features (float32), or of them rounded to bfloat16 (bf16 in);
- up to four rows (the integer dot products) it is the float32 matmul within the
  activations' rounding to 8 bits per block of 32, |y - y_ref| <= sum over blocks of
  (max|x| in the block / 254) x sum(|w| in the block) (test_gguf_kernel.py's bound), and,
  tighter, the matmul of the activations as rounded (quantize_q8's scheme, reproduced
  here) within float32 summation: 1e-5 of sum(|x_rounded| |w|) (measured: at most 4e-8),
  where a misplaced code or scale moves an output by a sizeable fraction of that sum (the
  last test shows it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize
from gguf_blocks import K_QUANTS, Q, k_quant_blocks

TILE = 2048  # output features per tile (gguf_bindings.cpp's kTileOuts)
SUM_ROUNDING = 1e-5


def _weights(n: int, k: int, qtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = k_quant_blocks(np.random.default_rng(seed), n, k, qtype)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, qtype).reshape(n, k))


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as quantize_q8 rounds it, in float64: per block of 32, float32 d = max|x| / 127 and
    q = nearest (ties to even) of x x (127 / max|x|), each a float32 operation (numpy's:
    torch's `127 / t` multiplies by a rounded reciprocal)."""
    rows, k = x.shape
    blocks = x.float().numpy().reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    q = np.rint(blocks * inv)
    return torch.from_numpy(q.astype(np.float64) * (amax / np.float32(127))).view(rows, k)


def _within_summation(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y is the matmul of x's rounded activations with w, up to float32 summation."""
    xr = _rounded(x)
    want = xr @ w.double().T
    slack = SUM_ROUNDING * (xr.abs() @ w.abs().double().T)
    if y.dtype == torch.bfloat16:  # and the output's rounding
        slack = slack + 2 ** -8 * want.abs()
    return bool(((y.double() - want).abs() <= slack).all())


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n, k", [(1, 5, 256), (3, 33, 512), (4, 40, 1536),
                                        (1, 576, 1536)])
def test_integer_path_is_the_dequantized_matmul_within_the_activation_rounding(ops, qtype, rows,
                                                                               n, k):
    blocks, w = _weights(n, k, qtype, seed=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 3
    y = ops.gguf_linear(x, blocks, int(qtype))
    want = x.double() @ w.double().T
    amax = x.abs().view(rows, k // 32, 32).amax(-1).repeat_interleave(32, -1).double()
    bound = (amax / 254) @ w.abs().double().T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs() <= bound * 1.001 + 1e-4).all()
    assert (y.double() - want).abs().max() > 1e-4, "the activations are rounded (8 bits)"
    assert _within_summation(y, x, w)
    x16 = x.to(torch.bfloat16)  # bf16 in and out: the output's rounding (2^-8) added
    y16 = ops.gguf_linear(x16, blocks, int(qtype))
    assert y16.dtype == torch.bfloat16 and _within_summation(y16, x16, w)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n, k", [(5, 7, 256), (17, 70, 768), (9, 2100, 512)])
def test_tiles_are_the_dequantized_matmul_exactly(ops, qtype, rows, n, k):
    """float32: the package's values; bf16: them rounded to bf16 (to nearest even). Each
    tile is one torch matmul, compared as such (torch's sums over 2,048 outputs and over
    more may be ordered differently)."""
    blocks, w = _weights(n, k, qtype, seed=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        y = ops.gguf_linear(xd, blocks, int(qtype))
        assert y.dtype == dtype and y.shape == (rows, n)
        for start in range(0, n, TILE):
            tile = slice(start, start + TILE)
            assert torch.equal(y[:, tile], F.linear(xd, wd[tile])), (dtype, start)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_dequantized_rows_are_the_gguf_packages(ops, qtype):
    blocks, w = _weights(40, 768, qtype, seed=1)
    ids = torch.tensor([39, 0, 7, 7])
    assert torch.equal(ops.gguf_dequantize(blocks, int(qtype), ids), w[ids])


def _misplaced(blocks: np.ndarray, qtype) -> np.ndarray:
    """The blocks with two sub-blocks' scales swapped (Q4_K, Q5_K: scale bytes 0 and 1 of
    12; Q6_K: int8 scales 0 and 2) and two code bytes swapped: what a kernel reading either
    from the wrong place would multiply."""
    out = blocks.reshape(blocks.shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1]).copy()
    a, b = (192, 194) if qtype == Q.Q6_K else (4, 5)
    out[..., [a, b]] = out[..., [b, a]]
    c = 0 if qtype == Q.Q6_K else 48 if qtype == Q.Q5_K else 16
    out[..., [c, c + 1]] = out[..., [c + 1, c]]
    return out.reshape(blocks.shape)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_the_checks_catch_a_misplaced_scale_or_code(ops, qtype):
    """The integer path's check, given the values of misplaced blocks, fails: it would fail
    a kernel that read a scale or a code from the wrong place."""
    blocks, w = _weights(64, 1536, qtype, seed=3)
    x = torch.randn(2, 1536, generator=torch.Generator().manual_seed(3)) * 3
    y = ops.gguf_linear(x, blocks, int(qtype))
    wrong = torch.from_numpy(dequantize(_misplaced(blocks.numpy(), qtype), qtype))
    assert _within_summation(y, x, w)
    assert not _within_summation(y, x, wrong.reshape(w.shape))


def test_a_row_must_be_whole_superblocks(ops):
    blocks, _ = _weights(4, 512, Q.Q5_K, seed=2)
    with pytest.raises(RuntimeError, match="not whole blocks of 176 bytes"):
        ops.gguf_linear(torch.randn(1, 512), blocks[:, :200].contiguous(), int(Q.Q5_K))
    with pytest.raises(RuntimeError, match=r"x: \[rows, 512\]"):
        ops.gguf_linear(torch.randn(1, 256), blocks, int(Q.Q5_K))
