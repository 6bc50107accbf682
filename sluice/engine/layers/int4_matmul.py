"""W4A16 matmul over GPTQ and AWQ (gemm) packed int4 weights: out = x @ W^T, each weight
tile unpacked inside the GEMM (vLLM's awq_triton `awq_gemm` and AutoGPTQ's Triton kernel).

The two packings, both int32 words of eight 4-bit codes, the lowest nibble first:
- GPTQ: `qweight` [K / 8, N], packed along the input; `qzeros` [K / G, N / 8], packed
  along the output in order; a v1 checkpoint (AutoGPTQ's) stores zero - 1, so 1 is added;
- AWQ: `qweight` [K, N / 8] and `qzeros` [K / G, N / 8], packed along the output in AWQ's
  interleaved order: nibble j holds output column [0, 2, 4, 6, 1, 3, 5, 7][j] of its eight,
  so column c lies in nibble c // 2 + 4 (c % 2).
`scales` [K / G, N] in both; W[n, k] = (q[k, n] - z[k // G, n]) x s[k // G, n].

A K step lies within one group (G % BLOCK_K == 0), so the step's integer codes, exact in
any float dtype, are multiplied by the activations first and the group's scale applied to
the partial product once per column. On CUDA this is the int4 layers' matmul; elsewhere
they multiply their dequantized weights, and the kernel runs in Triton's interpreter in the
tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GPTQ, AWQ = 0, 1  # the PACKING constexpr


@triton.jit
def _int4_mm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, GROUP,
                    stride_xm, stride_om, PACKING: tl.constexpr, ZERO_OFFSET: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """out[M, N] = x[M, K] . W[N, K]^T (+ bias), W unpacked per [BLOCK_K, BLOCK_N] tile
    (the module docstring). Contiguous qweight, qzeros, scales; GROUP % BLOCK_K == 0.
    Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    words = N // 8  # per qzeros row (and AWQ qweight row)
    if PACKING == 0:  # GPTQ: zeros in order along the output
        z_shift = (rn % 8) * 4
    else:  # AWQ: the interleaved order
        z_shift = ((rn % 8) // 2 + (rn % 2) * 4) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_ok[:, None], other=0.0)
        if PACKING == 0:  # word k // 8 of column n; the code of row k in nibble k % 8
            w = tl.load(qw_ptr + (k // 8)[:, None].to(tl.int64) * N + rn[None, :],
                        mask=n_ok[None, :], other=0)
            q = (w >> ((k % 8) * 4)[:, None]) & 0xF
        else:  # word n // 8 of row k
            w = tl.load(qw_ptr + k[:, None].to(tl.int64) * words + (rn // 8)[None, :],
                        mask=n_ok[None, :], other=0)
            q = (w >> z_shift[None, :]) & 0xF
        g = k0 // GROUP
        zw = tl.load(qz_ptr + g * words + rn // 8, mask=n_ok, other=0)
        z = ((zw >> z_shift) & 0xF) + ZERO_OFFSET
        s = tl.load(s_ptr + g * N + rn, mask=n_ok, other=0.0)
        codes = (q - z[None, :]).to(x.dtype)  # -16 .. 15: exact in fp16 / bf16
        acc += tl.dot(x, codes) * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_k(group: int) -> int:
    """The K step: the largest of 64 and 32 that divides the group."""
    assert group % 32 == 0, f"group size {group}: a multiple of 32"
    return 64 if group % 64 == 0 else 32


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
            scales: torch.Tensor, group: int, packing: int, zero_offset: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) times the packed weights' W [N, K] transposed; returns
    [M, N] in x's dtype. `packing` GPTQ or AWQ; zero_offset 1 for GPTQ v1, else 0."""
    m, k = x.shape
    n = scales.shape[1]
    if packing == GPTQ:
        assert qweight.shape == (k // 8, n), ("gptq qweight", qweight.shape, k, n)
    else:
        assert qweight.shape == (k, n // 8), ("awq qweight", qweight.shape, k, n)
    assert qzeros.shape == (k // group, n // 8) and scales.shape == (k // group, n)
    assert k % group == 0 and n % 8 == 0 and x.stride(1) == 1
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_mm_kernel[grid](
        x, qweight, qzeros, scales, bias if bias is not None else out, out, m, n, k, group,
        x.stride(0), out.stride(0), PACKING=packing, ZERO_OFFSET=zero_offset,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k(group))
    return out
