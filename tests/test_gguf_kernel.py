"""The GGUF kernels (csrc/gguf.c), on every instruction-set variant this CPU runs:
`gguf_dequantize` gives the gguf package's float32 values exactly, and `gguf_linear` gives
float32 dequantize-then-matmul within the bound of its one rounding, the activations' to
8 bits per block of 32: |y - y_ref| <= sum over blocks of (max|x| in the block / 254) x
sum(|w| in the block), plus float32 summation (above four rows, a float32 tile: exact up
to the summation). In bfloat16, the weights' and the output's rounding add 2^-8 each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]


def _weights(n: int, k: int, qtype, seed: int):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize(w, qtype)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, qtype).reshape(n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n, k", [(1, 5, 32), (3, 33, 64), (4, 40, 96), (17, 70, 576),
                                        (1, 256, 1536), (40, 2100, 64)])
def test_linear_is_the_dequantized_matmul_within_the_activation_rounding(ops, qtype, rows, n,
                                                                          k):
    blocks, w = _weights(n, k, qtype, seed=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 3
    y = ops.gguf_linear(x, blocks, int(qtype))
    want = x.double() @ w.double().T
    amax = x.abs().view(rows, k // 32, 32).amax(-1).repeat_interleave(32, -1).double()
    bound = (amax / 254) @ w.abs().double().T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs() <= bound * 1.001 + 1e-4).all()
    if rows <= 4:
        assert (y.double() - want).abs().max() > 1e-4, "the activations are rounded (8 bits)"
    # bf16 in, bf16 out; above four rows the weights go through a bf16 tile: add their
    # rounding and the output's (2^-8 relative each) to the bound
    x16 = x.to(torch.bfloat16)
    y16 = ops.gguf_linear(x16, blocks, int(qtype))
    want16 = x16.double() @ w.double().T
    loose = bound + 2 ** -8 * (x16.double().abs() @ w.abs().double().T + want16.abs())
    assert y16.dtype == torch.bfloat16
    assert ((y16.double() - want16).abs() <= loose * 1.001 + 1e-3).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantized_rows_are_the_gguf_packages(ops, qtype):
    blocks, w = _weights(40, 96, qtype, seed=1)
    ids = torch.tensor([39, 0, 7, 7])
    assert torch.equal(ops.gguf_dequantize(blocks, int(qtype), ids), w[ids])


def test_bad_arguments_are_errors(ops):
    blocks, _ = _weights(4, 64, T.Q4_1, seed=2)
    with pytest.raises(RuntimeError, match="has no kernel"):
        ops.gguf_linear(torch.randn(1, 64), blocks, int(T.Q2_K))
    with pytest.raises(RuntimeError, match=r"x: \[rows, 64\]"):
        ops.gguf_linear(torch.randn(1, 32), blocks, int(T.Q4_1))
    with pytest.raises(RuntimeError, match="not whole blocks"):
        ops.gguf_linear(torch.randn(1, 64), blocks[:, :30].contiguous(), int(T.Q4_1))
    with pytest.raises(RuntimeError, match="row 4 of 4"):
        ops.gguf_dequantize(blocks, int(T.Q4_1), torch.tensor([4]))
