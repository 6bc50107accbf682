"""A linear layer that adds the running adapters' deltas to its output.

A model built with LoRA on (`CausalLM(..., lora=LoRAContext)`) makes each target
projection a `LoRALinear` naming its parts (a fused qkv_proj: q_proj, k_proj, v_proj), so
the base weight and its kernel stay exactly `Linear`'s. The adapters' matrices live in
buffers stacked by batch slot, created once the model's dtype is known
(`create_lora_weights`) and written by the LoRA manager when an adapter takes a slot
(`set_lora`). Which rows run which slot is the forward's `LoRAMapping`, shared by every
layer through the context (vLLM's punica wrapper); outside `LoRAContext.use` there is
none, and the layer is the base linear.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from sluice.engine.distributed.parallel_state import SINGLE, TPGroup
from sluice.engine.layers.parallel_linear import (
    ColumnParallelLinear,
    PartShard,
    RowParallelLinear,
    column_shards,
)
from sluice.engine.layers.quantization import QuantMethod
from sluice.engine.lora.punica import LoRAMapping, lora_ops


class LoRAContext:
    """Shared by a model's LoRA layers: the delta's implementation, the slot layout, and
    the mapping of the forward in progress."""

    def __init__(self, max_loras: int, max_rank: int, device: torch.device):
        self.max_loras, self.max_rank, self.device = max_loras, max_rank, device
        self.ops = lora_ops(device)
        self.mapping: LoRAMapping | None = None

    @contextmanager
    def use(self, mapping: LoRAMapping | None) -> Iterator[None]:
        assert self.mapping is None, "LoRA mappings do not nest"
        self.mapping = mapping
        try:
            yield
        finally:
            self.mapping = None


class LoRALinear(ColumnParallelLinear):
    """A projection of one rank (adapters are served without tensor parallelism)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool,
                 ctx: LoRAContext):
        super().__init__(in_features, column_shards(parts, SINGLE), bias, SINGLE)
        self.ctx = ctx
        self.part_names, self.part_sizes = tuple(parts), tuple(parts.values())
        self.part_offsets = tuple(self.local_offsets.values())
        self.lora_a: torch.Tensor | None = None  # [slots, parts * rank, in]
        self.lora_b: torch.Tensor | None = None  # [slots, parts * rank, out], block-diagonal

    def create_lora_weights(self, dtype: torch.dtype) -> None:
        ctx, n = self.ctx, len(self.part_sizes)
        self.lora_a = torch.zeros(ctx.max_loras, n * ctx.max_rank, self.in_features,
                                  dtype=dtype, device=ctx.device)
        self.lora_b = torch.zeros(ctx.max_loras, n * ctx.max_rank, self.out_features,
                                  dtype=dtype, device=ctx.device)

    def set_lora(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these parts' (A [r, in], B [size, r]); the others are zero."""
        assert self.lora_a is not None and self.lora_b is not None, "create_lora_weights first"
        rank = self.ctx.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, name in enumerate(self.part_names):
            if name in weights:
                a, b = weights[name]
                r, off, size = a.shape[0], self.part_offsets[j], self.part_sizes[j]
                self.lora_a[slot, j * rank:j * rank + r].copy_(a)
                self.lora_b[slot, j * rank:j * rank + r, off:off + size].copy_(b.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        mapping = self.ctx.mapping
        if mapping is None or not mapping.segments:
            return y
        rows = x.reshape(-1, self.in_features)
        assert rows.shape[0] == mapping.num_tokens, "the mapping is another forward's"
        self.ctx.ops.add_lora(y.view(-1, self.out_features), rows, self.lora_a, self.lora_b,
                              self.part_sizes, mapping)
        return y


def column_linear(in_features: int, shards: dict[str, PartShard], bias: bool,
                  lora: LoRAContext | None, tp: TPGroup,
                  quant: QuantMethod | None = None) -> nn.Module:
    """The projection whose output is the parts `shards` names (transformers' module
    names), concatenated: column-parallel, a LoRALinear when the model serves adapters, or
    the quantization method's layer."""
    if quant is not None:
        assert tp.world_size == 1 and lora is None, "quantized: one rank, no adapters"
        return quant.linear(in_features, {n: s.total for n, s in shards.items()}, bias)
    if lora is None:
        return ColumnParallelLinear(in_features, shards, bias, tp)
    assert tp.world_size == 1, "adapters are served without tensor parallelism (config)"
    return LoRALinear(in_features, {n: s.total for n, s in shards.items()}, bias, lora)


def row_linear(in_features: int, part: str, out_features: int, bias: bool,
               lora: LoRAContext | None, tp: TPGroup,
               quant: QuantMethod | None = None) -> nn.Module:
    """The projection `part` that takes a column-parallel layer's output: row-parallel, a
    LoRALinear when the model serves adapters, or the quantization method's layer."""
    if quant is not None:
        assert tp.world_size == 1 and lora is None, "quantized: one rank, no adapters"
        return quant.linear(in_features, {part: out_features}, bias)
    if lora is None:
        return RowParallelLinear(in_features, out_features, bias, tp)
    assert tp.world_size == 1, "adapters are served without tensor parallelism (config)"
    return LoRALinear(in_features, {part: out_features}, bias, lora)
