"""RMSNorm and rotary embedding on CPU, bfloat16, as one op each (csrc/norm_rotary.c:
`torch.ops.sluice.rms_norm`, `rotary`).

Swapped in at load, as the packed linears are (`use_cpu_ops`): each RMSNorm module becomes a
NativeRMSNorm, each attention layer's `apply_rotary` becomes `native_rotary`. Eager PyTorch
runs an RMSNorm as 8 ops and a rotary as ~12: 12.1 and 15.5 us per call at one token, 6.1
and 7.6 us here, a batch-1 decode step 4.5 % shorter (docs/benchmarks.md). float32 keeps the
PyTorch modules (the exactness reference); so does an install without the kernels.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sluice.engine import kernels
from sluice.engine.model.decoder import Attention
from sluice.engine.model.layers import RMSNorm


class NativeRMSNorm(nn.Module):
    """RMSNorm of bf16 rows [tokens, hidden] whose elements are contiguous (the hidden
    states); anything else (Qwen3's per-head q/k norms) goes through the PyTorch module it
    replaced."""

    def __init__(self, norm: RMSNorm, ops):
        super().__init__()
        self.fallback, self._ops = norm, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            return self.fallback(x)
        return self._ops.rms_norm(x, self.fallback.weight, self.fallback.eps)


def native_rotary(ops, cos_sin: tuple[torch.Tensor, torch.Tensor],
                  q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding.apply for bf16 q [T, heads, D] and k [T, kv_heads, D] whose heads are
    contiguous within a token (views into the fused qkv output are)."""
    cos, sin = cos_sin
    return ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)


def use_cpu_ops(model: nn.Module, dtype: torch.dtype) -> bool:
    """Swap `model`'s RMSNorms and rotaries for the kernels' where they apply (bf16, the
    kernels installed); True when swapped."""
    ops = kernels.ops() if dtype == torch.bfloat16 else None
    if ops is None:
        return False
    norms = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, RMSNorm)]
    for parent, name, child in norms:
        setattr(parent, name, NativeRMSNorm(child, ops))
    for module in model.modules():
        if isinstance(module, Attention):
            module.apply_rotary = functools.partial(native_rotary, ops)
    return True
