"""The KV cache's storage type (`--kv-cache-dtype`, vLLM's flag): the model's dtype (auto), or
float8 e4m3 (fp8, fp8_e4m3), one byte per value, so the same memory holds twice the blocks
of a bfloat16 cache.

Scaling is vLLM's: a layer has one scale for its keys and one for its values (`KVScale`,
1.0 unless the checkpoint gives `self_attn.k_scale` / `v_scale`); the cache stores
x / scale, saturated to e4m3's +-448, and attention reads value x scale. Every backend
writes through `quantize` (torch rounds to nearest even), so they hold the same bits; the
CPU kernel applies the scales to the scores and the output rather than to each value (the
same result up to float32 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.config import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


@dataclass(frozen=True)
class KVScale:
    """One layer's fp8 scales: stored = key / k, value / v. Other cache dtypes ignore them."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        assert self.k > 0 and self.v > 0, "KV scales are positive"


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for --kv-cache-dtype `name` (CacheConfig checked it) and model
    dtype `dtype`."""
    assert name in KV_CACHE_DTYPES, name
    return dtype if name == "auto" else FP8


def quantize(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: x / scale in fp8 (saturated), else x itself."""
    if cache_dtype != FP8:
        return x
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values in `dtype`: fp8 ones times scale (in float32, then rounded once)."""
    if stored.dtype != FP8:
        return stored
    return (stored.float() * scale).to(dtype)


def storage(t: torch.Tensor) -> torch.Tensor:
    """A view torch's indexing kernels take: fp8 as uint8 (same bytes); others as they are."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
