"""Building blocks of the decoder: RMSNorm, rotary embeddings (incl. llama3 scaling), SwiGLU.

RMSNorm and rotary take the engine's CPU kernels (`sluice.engine.kernels`: one op each where
eager PyTorch runs 8 and ~12; per call at one token 12.1 -> 4.7 us and 15.5 -> 3.4 us,
docs/benchmarks.md) for bf16 on the CPU, in the layouts the kernels read; everything else
(float32, the exactness reference the tests hold against transformers; GPUs; other
layouts) runs the PyTorch ops (`forward_native`, `apply_native`). The kernels round where
PyTorch rounds: rotary is bit-equal, RMSNorm too but for its sum of squares' order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine import kernels
from sluice.engine.model.linear import Linear

BF16 = torch.bfloat16


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 as transformers does. The
    kernel takes bf16 rows [tokens, hidden] on the CPU whose elements are contiguous (the
    hidden states); Qwen3's 3-D per-head norms and all else take `forward_native`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels.ops()  # (None: not installed)
        if (ops is not None and x.dtype == BF16 and self.weight.dtype == BF16
                and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"):
            return ops.rms_norm(x, self.weight, self.eps)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
