"""The LoRA delta as Triton kernels (CUDA; tested under TRITON_INTERPRET=1): BGMV, each
row reads the matrices of its own slot (`LoRAMapping.token_slots`, -1: no adapter).

shrink: h[t, k] = sum_i x[t, i] a[s_t, k, i]      (k < w = parts x rank)
expand: y[t, n] += sum_k h[t, k] b[s_t, k, n]     (b block-diagonal: punica.py)
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
def _expand(h_ptr, b_ptr, y_ptr, slots_ptr, W, N,
            sh, sb0, sb1, sy, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    live = slot >= 0
    s = tl.maximum(slot, 0)
    k = tl.arange(0, BLOCK_W)
    hv = tl.load(h_ptr + t * sh + k, mask=(k < W) & live, other=0.0)
    bv = tl.load(b_ptr + s * sb0 + k[:, None] * sb1 + n[None, :],
                 mask=(k[:, None] < W) & (n[None, :] < N) & live, other=0.0)
    delta = tl.sum(bv.to(tl.float32) * hv[:, None], axis=0)
    ptr = y_ptr + t * sy + n
    mask = (n < N) & live
    y = tl.load(ptr, mask=mask, other=0.0)
    tl.store(ptr, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


class TritonLoRAOps:
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 part_sizes: tuple[int, ...], mapping: LoRAMapping) -> None:
        slots = mapping.token_slots
        assert slots.numel() == x.shape[0] == y.shape[0]
        assert x.stride(1) == a.stride(2) == b.stride(2) == y.stride(1) == 1
        num_rows, k = x.shape
        w, n = a.shape[1], y.shape[1]
        h = torch.empty(num_rows, w, dtype=torch.float32, device=x.device)
        _shrink[(num_rows, triton.cdiv(w, 32))](
            x, a, h, slots, k, w, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            BLOCK_N=32, BLOCK_K=64)
        _expand[(num_rows, triton.cdiv(n, 64))](
            h, b, y, slots, w, n, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_N=64, BLOCK_W=triton.next_power_of_2(w))
