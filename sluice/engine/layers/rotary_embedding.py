"""Rotary position embeddings (rotate-half RoPE, with llama3 or linear frequency scaling).
bf16 q and k on the CPU take the engine's kernel (`sluice.engine.kernels`: one op where
eager PyTorch runs ~12; per call at one token 15.5 -> 3.4 us, docs/benchmarks.md),
bit-equal to `apply_native`, which everything else runs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sluice.engine import kernels

BF16 = torch.bfloat16


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies, with llama3 (wavelength-banded) or linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE. `cos_sin(positions)` is computed once per step and shared by every
    layer; `apply` rotates one layer's q and k with it."""

    def __init__(self, head_dim: int, theta: float, scaling: dict):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)  # [T, 1, D]

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        """q [T, heads, D] and k [T, kv_heads, D] rotated; the kernel where both are bf16 on
        the CPU with heads contiguous within a token (views into the fused qkv output are)."""
        cos, sin = cos_sin
        ops = kernels.ops()
        if (ops is not None and q.dtype == k.dtype == cos.dtype == BF16
                and q.device.type == "cpu" and _heads_contiguous(q) and _heads_contiguous(k)
                and cos.is_contiguous() and sin.is_contiguous()):
            return ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
        return RotaryEmbedding.apply_native(cos_sin, q, k)

    @staticmethod
    def apply_native(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                     k: torch.Tensor):
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
