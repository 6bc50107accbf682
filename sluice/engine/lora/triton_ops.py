"""The LoRA delta as Triton kernels (CUDA; tested under TRITON_INTERPRET=1): BGMV, each
row reads the matrices of its own slot (`LoRAMapping.token_slots`, -1: no adapter).

shrink: h[t, n] = sum_k x[t, k] a[s_t, n, k]           (n < parts * rank)
expand: y[t, off + n] += sum_r h[t, j * rank + r] b[s_t, off + n, r]   (per part j)
Both accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.engine.lora.punica import LoRAMapping


@triton.jit
def _shrink(x_ptr, a_ptr, h_ptr, slots_ptr, K, N,
            sx, sa0, sa1, sh, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    live = slot >= 0
    s = tl.maximum(slot, 0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * sx + k, mask=(k < K) & live, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + s * sa0 + n[:, None] * sa1 + k[None, :],
                     mask=(n[:, None] < N) & (k[None, :] < K) & live, other=0.0)
        acc += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    tl.store(h_ptr + t * sh + n, acc, mask=(n < N) & live)


@triton.jit
def _expand(h_ptr, b_ptr, y_ptr, slots_ptr, h_off, y_off, R, N,
            sh, sb0, sb1, sy, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    live = slot >= 0
    s = tl.maximum(slot, 0)
    r = tl.arange(0, BLOCK_R)
    hv = tl.load(h_ptr + t * sh + h_off + r, mask=(r < R) & live, other=0.0)
    bv = tl.load(b_ptr + s * sb0 + (y_off + n[:, None]) * sb1 + r[None, :],
                 mask=(n[:, None] < N) & (r[None, :] < R) & live, other=0.0)
    delta = tl.sum(bv.to(tl.float32) * hv[None, :], axis=1)
    ptr = y_ptr + t * sy + y_off + n
    mask = (n < N) & live
    y = tl.load(ptr, mask=mask, other=0.0)
    tl.store(ptr, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


class TritonLoRAOps:
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 parts: tuple[tuple[int, int], ...], rank: int, mapping: LoRAMapping) -> None:
        if not mapping.segments:
            return
        slots = mapping.token_slots
        assert slots is not None and slots.numel() == x.shape[0] == y.shape[0]
        assert x.stride(1) == a.stride(2) == b.stride(2) == y.stride(1) == 1
        num_rows, k = x.shape
        n = a.shape[1]
        h = torch.empty(num_rows, n, dtype=torch.float32, device=x.device)
        block_n = 32
        _shrink[(num_rows, triton.cdiv(n, block_n))](
            x, a, h, slots, k, n, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            BLOCK_N=block_n, BLOCK_K=64)
        block_r = triton.next_power_of_2(rank)
        for j, (off, size) in enumerate(parts):
            _expand[(num_rows, triton.cdiv(size, 64))](
                h, b, y, slots, j * rank, off, rank, size, h.stride(0), b.stride(0),
                b.stride(1), y.stride(0), BLOCK_N=64, BLOCK_R=block_r)
