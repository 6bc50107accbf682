"""RMSNorm and rotary embedding on CPU, bfloat16, as one C call each (cpu_ops.c).

Swapped in at load, as the packed linears are (`use_cpu_ops`): each RMSNorm module becomes a
NativeRMSNorm, each attention layer's `apply_rotary` becomes `native_rotary`. Eager PyTorch
runs an RMSNorm as 8 ops and a rotary as ~12: 12.1 and 15.5 us per call at one token, 6.1
and 7.6 us here, a batch-1 decode step 4.5 % shorter (docs/benchmarks.md). float32 keeps the
PyTorch modules (the exactness reference); so does a machine without a C compiler.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from sluice.engine import native
from sluice.engine.model.decoder import Attention
from sluice.engine.model.layers import RMSNorm

SOURCE = Path(__file__).with_name("cpu_ops.c")
# No contraction into fused multiply-adds: PyTorch rounds each product on its own.
FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared"]


@functools.cache
def load() -> ctypes.CDLL | None:
    path = native.build(SOURCE, [*FLAGS, native.arch_flag()])
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.sluice_rms_norm.argtypes = [p, i64, p, p, i64, i32, ctypes.c_float]
    lib.sluice_rms_norm.restype = None
    lib.sluice_rotary.argtypes = [p, i64, p, p, p, i64, i32, i32]
    lib.sluice_rotary.restype = None
    return lib


class NativeRMSNorm(nn.Module):
    """RMSNorm of bf16 rows [tokens, hidden] whose elements are contiguous (the hidden
    states); anything else (Qwen3's per-head q/k norms) goes through the PyTorch module it
    replaced."""

    def __init__(self, norm: RMSNorm, lib: ctypes.CDLL):
        super().__init__()
        self.fallback, self._lib = norm, lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            return self.fallback(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._lib.sluice_rms_norm(x.data_ptr(), x.stride(0), self.fallback.weight.data_ptr(),
                                  out.data_ptr(), x.shape[0], x.shape[1], self.fallback.eps)
        return out


def native_rotary(lib: ctypes.CDLL, cos_sin: tuple[torch.Tensor, torch.Tensor],
                  q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding.apply for bf16 q [T, heads, D] and k [T, kv_heads, D] whose heads are
    contiguous within a token (views into the fused qkv output are)."""
    cos, sin = cos_sin
    return _rotate(lib, q, cos, sin), _rotate(lib, k, cos, sin)


def _rotate(lib, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads contiguous within a token"
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == x.dtype
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.sluice_rotary(x.data_ptr(), x.stride(0), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      tokens, heads, head_dim)
    return out


def use_cpu_ops(model: nn.Module, dtype: torch.dtype) -> bool:
    """Swap `model`'s RMSNorms and rotaries for the C ones where they apply (bf16, a
    compiler); True when swapped."""
    lib = load() if dtype == torch.bfloat16 else None
    if lib is None:
        return False
    norms = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, RMSNorm)]
    for parent, name, child in norms:
        setattr(parent, name, NativeRMSNorm(child, lib))
    for module in model.modules():
        if isinstance(module, Attention):
            module.apply_rotary = functools.partial(native_rotary, lib)
    return True
