"""Linear layers on CPU with the weight in oneDNN's blocked layout.

`nn.Linear` multiplies by the weight as stored ([out, in], row-major). oneDNN reorders a
weight once into the blocked layout its bf16 kernels stream (`mkldnn._reorder_linear_weight`)
and multiplies by that (`mkldnn._linear_pointwise`): the ops inductor's freezing pass emits
for CPU linears. The arithmetic is the same (outputs bit-identical in the tests); the decode
step's weight traffic, which bounds a CPU decode, goes faster. Measured on this project's
2-vCPU machine, one thread, the 30 layers' linears of SmolLM2-135M, weights streamed from
memory: 32.5 -> 17.6 ms at 8 rows, 55.1 -> 39.1 ms at 32, 542 -> 507 ms at 512
(docs/benchmarks.md).

Only bf16 and fp16 weights are packed, and only where oneDNN has kernels for them: float32
keeps torch's kernel, the exactness reference the tests compare transformers against.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W held only in oneDNN's layout (the plain copy is dropped)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).contiguous(),
                                               self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear; returns how many. A weight
    tied to another module (the LM head to the embeddings) stays there as it was."""
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return len(linears)
