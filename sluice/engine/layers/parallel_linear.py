"""Tensor-parallel linear layers, as vLLM's: each rank holds a shard of the weight, read
from the checkpoint by `weight_loader` (its rows or columns only: a safetensors slice is
read in part, never whole), and runs the kernel `Linear` chooses for the shard.

- Column-parallel (q/k/v, gate/up): each rank computes its slice of every part's output;
  no communication. `QKV` shards q's heads, and k's and v's where there are at least as
  many as ranks; with fewer, each kv head is replicated over tp / num_kv_heads ranks
  (vLLM's rule), so each rank's attention has whole heads, and its KV cache its own.
- Row-parallel (o, down): each rank multiplies its slice of the input features (the
  column-parallel layer's output slice) by its columns of the weight; one all-reduce sums
  the partial outputs, and the bias is added once, after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.distributed.parallel_state import TPGroup, divide
from sluice.engine.layers.linear import Linear


@dataclass(frozen=True)
class PartShard:
    """A rank's rows of one part of a column-parallel output: [start, start + size)."""

    start: int
    size: int


def column_shards(sizes: dict[str, int], tp: TPGroup) -> dict[str, PartShard]:
    """Each part split evenly over the ranks."""
    out = {}
    for name, size in sizes.items():
        local = divide(size, tp.world_size, f"{name}'s output size")
        out[name] = PartShard(tp.rank * local, local)
    return out


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int,
               tp: TPGroup) -> dict[str, PartShard]:
    """q's heads split over the ranks; k's and v's split too, or replicated when there are
    fewer than ranks (then tp must be a multiple of them)."""
    n = tp.world_size
    heads = divide(num_heads, n, "the number of attention heads")
    q = PartShard(tp.rank * heads * head_dim, heads * head_dim)
    if num_kv_heads >= n:
        kv_heads = divide(num_kv_heads, n, "the number of key/value heads")
        kv = PartShard(tp.rank * kv_heads * head_dim, kv_heads * head_dim)
    else:
        replicas = divide(n, num_kv_heads, "with fewer key/value heads than ranks, the "
                          "tensor-parallel size divided by them; the ranks")
        kv = PartShard((tp.rank // replicas) * head_dim, head_dim)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv}


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

    def weight_loader(self, part: str, full, is_bias: bool = False) -> None:
        """Copy this rank's rows of `part` from its full checkpoint tensor ([out, in], or
        [out] for a bias; a tensor or a safetensors slice)."""
        s, off = self.shards[part], self.local_offsets[part]
        target = self.bias if is_bias else self.weight
        with torch.no_grad():
            target[off:off + s.size].copy_(full[s.start:s.start + s.size])


class RowParallelLinear(Linear):
    """y = all_reduce(x_shard W[:, shard]^T) + b: x holds this rank's input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        local = divide(in_features, tp.world_size, "the input size of a row-parallel layer")
        super().__init__(local, out_features, bias=False)
        self.tp, self.full_in = tp, in_features
        self.reduced_bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None

    def weight_loader(self, full, is_bias: bool = False) -> None:
        with torch.no_grad():
            if is_bias:
                self.reduced_bias.copy_(full[:])
                return
            start = self.tp.rank * self.in_features
            self.weight.copy_(full[:, start:start + self.in_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(super().forward(x))
        return y if self.reduced_bias is None else y + self.reduced_bias
