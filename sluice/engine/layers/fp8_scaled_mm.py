"""W8A8 float8 matmul: activations quantized to e4m3 per token (or per token and group of
128 inputs), weights stored in e4m3 with per-channel or 128 x 128 block scales, products
summed in float32 and scaled once per tile (vLLM's `scaled_fp8_quant` + `cutlass_scaled_mm`
policy, and its block-wise `w8a8_block_fp8_matmul`).

`quantize_per_token` runs in torch; `scaled_mm` is a Triton kernel: on a GPU with float8
tensor cores (sm_89 and later) it is the fp8 layers' matmul; elsewhere the layers multiply
their dequantized weights, and the kernel runs in Triton's interpreter in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # block-wise scaling: a weight block is GROUP x GROUP, an activation group GROUP


def quantize_per_token(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1], or [M, K / group] with group > 0),
    x ~ q * scale; each scale maps its row's (group's) largest magnitude to 448."""
    m, k = x.shape
    assert not group or k % group == 0, f"{k} inputs do not split into groups of {group}"
    view = x.float().view(m, k // group, group) if group else x.float().view(m, 1, k)
    scale = (view.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
    q = (view / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, k), scale.view(m, -1)


@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K,
                      stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                      HAS_BIAS: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[M, N] = (A[M, K] . B[N, K]^T) x scales (+ bias). GROUP_K == 0: per-row A scales
    [M] and per-column B scales [N], applied after the K loop; GROUP_K > 0 (== BLOCK_K):
    A scales [M, K / GROUP_K] and B block scales [N / GROUP_K, K / GROUP_K], applied to
    each K step's partial product. Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * stride_bn + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b))
        if GROUP_K:
            g = k0 // GROUP_K
            a_s = tl.load(a_scale_ptr + rm * stride_asm + g, mask=m_ok, other=0.0)
            b_s = tl.load(b_scale_ptr + (rn // GROUP_K) * stride_bsn + g, mask=n_ok, other=0.0)
            acc += part * a_s[:, None] * b_s[None, :]
        else:
            acc += part
    if not GROUP_K:
        a_s = tl.load(a_scale_ptr + rm * stride_asm, mask=m_ok, other=0.0)
        b_s = tl.load(b_scale_ptr + rn, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              group: int = 0) -> torch.Tensor:
    """a: e4m3 [M, K] with scales [M, 1] (group 0) or [M, K / group]; b: e4m3 [N, K] with
    scales [N] (group 0) or [N / group, K / group] (ceil). Returns [M, N] in out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    assert a.dtype == b.dtype == FP8 and b.shape[1] == k, (a.dtype, b.dtype, a.shape, b.shape)
    assert a.stride(1) == 1 and b.stride(1) == 1, "K contiguous"
    assert not group or (group == GROUP and a_scale.shape == (m, -(-k // group))
                         and b_scale.shape == (-(-n // group), -(-k // group))), "block scales"
    assert group or (a_scale.shape == (m, 1) and b_scale.shape == (n,)), "per-token/channel"
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, group or 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_mm_kernel[grid](
        a, b, out, a_scale, b_scale, bias if bias is not None else out, m, n, k,
        a.stride(0), b.stride(0), out.stride(0), a_scale.stride(0),
        b_scale.stride(0) if group else 0,
        HAS_BIAS=bias is not None, GROUP_K=group, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)
    return out
