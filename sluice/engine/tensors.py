"""Host -> device copies that do not synchronise the GPU."""

from __future__ import annotations

import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `data` on `device`; on CUDA staged in pinned memory and copied
    asynchronously (a copy from pageable memory would wait for the GPU to drain)."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
