"""The W4A16 int4 matmul (layers/int4_matmul.py) against the reference dequantization
(int4_formats.py) multiplied in float32: both packings, groups of 32 to a whole row, ragged
M and N, bias; fp16 activations; the build for sm_90. On CPU the kernel runs in Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch
from int4_formats import reference
from triton_aot import run_aot_script

from sluice.engine.layers.int4_matmul import AWQ, GPTQ, int4_mm

pytestmark = pytest.mark.slow  # Triton's interpreter on CPU; the sm_90 build (~4 s)


@pytest.mark.parametrize("m, n, k, group, fmt", [
    (1, 96, 256, 128, "gptq"), (5, 200, 384, 64, "gptq"), (33, 64, 256, 256, "gptq"),
    (1, 96, 256, 128, "awq"), (5, 200, 384, 32, "awq"), (33, 136, 256, 64, "awq"),
])
def test_int4_mm_equals_the_dequantized_product(m, n, k, group, fmt):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + group)
    awq = fmt == "awq"

    def words(rows, cols):
        return torch.randint(-2**31, 2**31, (rows, cols), generator=gen, dtype=torch.int64).to(
            torch.int32)

    qweight = words(k, n // 8) if awq else words(k // 8, n)
    qzeros = words(k // group, n // 8)
    scales = (torch.rand(k // group, n, generator=gen) * 0.01).half().float()
    offset = 0 if awq else 1
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    want = x @ reference(fmt, qweight, qzeros, scales, group, offset).T + bias
    got = int4_mm(x, qweight, qzeros, scales, group, AWQ if awq else GPTQ, offset, bias)
    # float32 sums of the same products in another order (scales applied per K step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_int4_mm_in_fp16_rounds_only_the_output(fmt):
    """fp16 activations (a GPU engine's dtype): the codes are exact in fp16 and the sums
    float32, so the result is the float32 product of the fp16 activations, rounded once.
    (bf16 is not checked here: Triton 3.7's interpreter gets bf16 dots and int -> bf16
    conversions wrong; the sm_90 compile check builds the bf16 kernel.)"""
    gen = torch.Generator().manual_seed(7)
    awq, (m, n, k, group) = fmt == "awq", (3, 64, 256, 128)
    qweight = torch.randint(-2**31, 2**31, (k, n // 8) if awq else (k // 8, n), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31, (k // group, n // 8), generator=gen,
                           dtype=torch.int64).to(torch.int32)
    scales = torch.rand(k // group, n, generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen).half()
    got = int4_mm(x, qweight, qzeros, scales, group, AWQ if awq else GPTQ, 0 if awq else 1)
    want = x.float() @ reference(fmt, qweight, qzeros, scales, group, 0 if awq else 1).T
    assert got.dtype == torch.float16
    # one fp16 rounding of the output (2^-11 relative), float32 sums in another order
    torch.testing.assert_close(got.float(), want, rtol=2**-10, atol=1e-5 * want.abs().max())


_AOT_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sluice.engine.layers import int4_matmul as K

fn = K._int4_mm_kernel
types = {"x_ptr": "*bf16", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp32",
         "bias_ptr": "*bf16", "out_ptr": "*bf16"}
for packing, offset in ((K.GPTQ, 1), (K.AWQ, 0)):
    for block_m in (16, 64):  # int4_mm's two row tiles
        consts = dict(PACKING=packing, ZERO_OFFSET=offset, HAS_BIAS=True, BLOCK_M=block_m,
                      BLOCK_N=64, BLOCK_K=K.block_k(128))
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4})
        assert "mma" in kernel.asm["ptx"], "no tensor-core dot"
        print("ok", packing, block_m, flush=True)
"""


def test_compiles_for_sm90(tmp_path):
    """The kernel as int4_mm launches it compiles for sm_90 (bf16 tensor-core dots)."""
    res = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert res.returncode == 0 and res.stdout.count("ok") == 4, res.stdout + res.stderr
