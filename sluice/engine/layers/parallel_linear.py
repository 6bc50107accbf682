"""Tensor-parallel linear layers, as vLLM's: each rank holds a shard of the weight, read
from the checkpoint by `weight_loader` (its rows or columns only: a safetensors slice is
read in part, never whole), and runs the kernel `Linear` chooses for the shard. With a
group of one (`SINGLE`) each is exactly `Linear`.

- Column-parallel (q/k/v, gate/up): each rank computes its slice of every part's output;
  no communication. `qkv_shards` shards q's heads, and k's and v's where there are at
  least as many as ranks; with fewer, each kv head is replicated over tp / num_kv_heads
  ranks (vLLM's rule), so each rank's attention has whole heads, and its KV cache its own.
- Row-parallel (o, down): each rank multiplies its slice of the input features (the
  column-parallel layer's output slice) by its columns of the weight; one all-reduce sums
  the partial outputs, and the bias is added once, after it.

Loading contract (every layer with a shard): `weight_loader(param, full, part)` copies
this rank's share of the checkpoint tensor `full` (a tensor or a safetensors slice, in
transformers' layout) into parameter `param` ("weight" or "bias"); `part` is the
checkpoint's module name (q_proj, ...), which picks the rows of a fused layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.distributed.parallel_state import TPGroup, divide, kv_replicas
from sluice.engine.layers.linear import Linear


@dataclass(frozen=True)
class PartShard:
    """A rank's rows of one part of a column-parallel output: [start, start + size) of
    the part's `total` rows."""

    start: int
    size: int
    total: int


def column_shards(sizes: dict[str, int], tp: TPGroup) -> dict[str, PartShard]:
    """Each part split evenly over the ranks."""
    out = {}
    for name, size in sizes.items():
        local = divide(size, tp.world_size, f"{name}'s output size")
        out[name] = PartShard(tp.rank * local, local, size)
    return out


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: its share, or one replicated head when they are fewer."""
    return max(1, num_kv_heads // tp_size)


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int,
               tp: TPGroup) -> dict[str, PartShard]:
    """q's heads split over the ranks; k's and v's split too, or replicated when there are
    fewer than ranks (then tp must be a multiple of them)."""
    n = tp.world_size
    heads = divide(num_heads, n, "the number of attention heads")
    q = PartShard(tp.rank * heads * head_dim, heads * head_dim, num_heads * head_dim)
    replicas = kv_replicas(num_kv_heads, n)
    local = kv_heads_per_rank(num_kv_heads, n) * head_dim
    kv = PartShard((tp.rank // replicas) * local, local, num_kv_heads * head_dim)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv}


def check_shape(full, want: tuple[int, ...], what: str) -> None:
    """ValueError unless the checkpoint tensor (or slice) has shape `want`."""
    shape = tuple(full.get_shape() if hasattr(full, "get_shape") else full.shape)
    if shape != want:
        raise ValueError(f"weight {what}: shape {shape} != {want}")


class ColumnParallelLinear(Linear):
    """y[:, this rank's slice of each part] = x W_shard^T (+ b_shard), parts in order."""

    def __init__(self, in_features: int, shards: dict[str, PartShard], bias: bool,
                 tp: TPGroup):
        super().__init__(in_features, sum(s.size for s in shards.values()), bias)
        self.shards, self.tp = shards, tp
        offsets, off = {}, 0
        for name, s in shards.items():
            offsets[name] = off
            off += s.size
        self.local_offsets = offsets

    def weight_loader(self, param: str, full, part: str) -> None:
        s, off = self.shards[part], self.local_offsets[part]
        check_shape(full, (s.total, self.in_features) if param == "weight" else (s.total,),
                    f"{part}.{param}")
        with torch.no_grad():
            getattr(self, param)[off:off + s.size].copy_(full[s.start:s.start + s.size])


class RowParallelLinear(Linear):
    """y = all_reduce(x_shard W[:, shard]^T) + b: x holds this rank's input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        local = divide(in_features, tp.world_size, "the input size of a row-parallel layer")
        super().__init__(local, out_features, bias)
        self.tp, self.full_in = tp, in_features

    def weight_loader(self, param: str, full, part: str) -> None:
        with torch.no_grad():
            if param == "bias":
                check_shape(full, (self.out_features,), f"{part}.bias")
                self.bias.copy_(full[:])
                return
            check_shape(full, (self.out_features, self.full_in), f"{part}.weight")
            start = self.tp.rank * self.in_features
            self.weight.copy_(full[:, start:start + self.in_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
