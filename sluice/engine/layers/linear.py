"""The model's linear layer: y = x W^T (+ b), its kernel chosen once its weight is loaded.

The weight is loaded as stored ([out, in], transformers' names and layout). Then
`process_weights_after_loading` (vLLM's hook name) picks the kernel for the weight's dtype
and device:
- on a CPU whose oneDNN has bf16 (or fp16) kernels, and a weight of that dtype: the weight
  is reordered once into the blocked layout oneDNN's kernels stream
  (`mkldnn._reorder_linear_weight`), the plain copy dropped, and every call runs
  `mkldnn._linear_pointwise`: the ops inductor's freezing pass emits for CPU linears. The
  arithmetic is the same (outputs bit-identical in the tests); the decode step's weight
  traffic, which bounds a CPU decode, goes faster. Measured on this project's 2-vCPU
  machine, one thread, the 30 layers' linears of SmolLM2-135M, weights streamed from
  memory: 32.5 -> 17.6 ms at 8 rows, 55.1 -> 39.1 ms at 32, 542 -> 507 ms at 512
  (docs/benchmarks.md);
- anything else (float32, the exactness reference the tests hold against transformers;
  GPUs): torch's `F.linear` on the weight as loaded.
A weight tied to another module (the LM head to the embeddings) stays there as it was:
only this layer's reference is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout, once loaded

    @classmethod
    def from_weights(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """A loaded layer over `weight` [out, in] (+ bias), its kernel chosen: the plain
        layer a quantized one falls back to where its own kernel does not run."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        layer.process_weights_after_loading()
        return layer

    def process_weights_after_loading(self) -> None:
        """Choose the kernel for the loaded weight (see the module docstring). Once."""
        assert self.packed is None, "weights processed twice"
        w = self.weight
        if can_pack(w.dtype, w.device):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            del self.weight  # (a tied weight lives on in the module it is tied to)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) by the chosen kernel."""
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).contiguous(),
                                               self.packed, bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kernel = "oneDNN packed" if self.packed is not None else "torch"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={kernel}")
