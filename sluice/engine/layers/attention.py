"""The attention layer: one decoder layer's paged attention through the engine's attention
backend (`sluice/engine/attention/`: the CPU kernel, PyTorch, Triton), chosen by the
engine at start-up and shared by every layer."""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.attention.backend import AttentionBackend, AttentionMetadata
from sluice.engine.attention.kv_quant import KVScale


class Attention(nn.Module):
    """Writes this step's k and v into their KV-cache slots, then attends each query row to
    every cached token of its sequence up to its own position.

    q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim].
    An fp8 cache holds k / kv_scale.k and v / kv_scale.v (the checkpoint's scales, else 1)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend):
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads come in groups per KV head"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend
        self.kv_scale = KVScale()

    def load_kv_scale(self, name: str, value: float) -> None:
        """The checkpoint's `k_scale` or `v_scale` (vLLM's names for the fp8 cache's scales)."""
        if name not in ("k_scale", "v_scale"):
            raise ValueError(f"unexpected attention parameter {name!r}")
        k, v = self.kv_scale.k, self.kv_scale.v
        self.kv_scale = KVScale(value, v) if name == "k_scale" else KVScale(k, value)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.backend.write_kv(k, v, kv_cache, meta, self.kv_scale)
        return self.backend.attend(q, kv_cache, meta, self.scale, self.kv_scale)
