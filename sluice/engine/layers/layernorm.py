"""RMSNorm. bf16 rows on the CPU take the engine's kernel (`sluice.engine.kernels`: one op
where eager PyTorch runs 8; per call at one token 12.1 -> 4.7 us, docs/benchmarks.md), in
the layout it reads; everything else (float32, the exactness reference the tests hold
against transformers; GPUs; other layouts) runs `forward_native`. The kernel rounds where
PyTorch rounds, but for its sum of squares' order.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine import kernels

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
