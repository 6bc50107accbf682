"""KV blocks moved whole-headed in and out of a tensor-parallel engine, for a KV transfer
(kv_transfer/). The wire carries every KV head of a block (tcp_transport.py), whatever
either engine's tensor-parallel size, while each rank's cache holds its heads only.
Rank 0 drives both directions on the core thread, the workers joining as for a step:
- gather (a prefill engine's held blocks): each rank selects its heads of the blocks; they
  are gathered on rank 0 along the heads, one replica of each replicated KV head kept;
- scatter (a decode engine's pulled blocks): rank 0 broadcasts the blocks, and each rank
  copies its heads into its cache.
Whole-headed blocks are [layers, 2 (k, v), blocks, kv heads, block size, head dim]."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sluice.engine.attention.kv_quant import storage
from sluice.engine.distributed.messages import GatherKV, ScatterKV
from sluice.engine.distributed.parallel_state import TPGroup, kv_replicas
from sluice.engine.layers.parallel_linear import kv_heads_per_rank


def _heads(num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int]:
    """(this rank's first head, its head count, replicas of each head)."""
    local = kv_heads_per_rank(num_kv_heads, tp.world_size)
    replicas = kv_replicas(num_kv_heads, tp.world_size)
    return (tp.rank // replicas) * local, local, replicas


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], tp: TPGroup,
                  num_kv_heads: int) -> torch.Tensor | None:
    """The blocks with every KV head, on rank 0 (None on the others); every rank calls it."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    mine = torch.stack([storage(c).index_select(1, idx) for c in kv_caches])
    whole = tp.gather(mine, dim=3)
    _, _, replicas = _heads(num_kv_heads, tp)
    return (None if whole is None
            else whole[:, :, :, ::replicas].contiguous().view(kv_caches[0].dtype))


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: list[int],
                   whole: torch.Tensor | None, tp: TPGroup, num_kv_heads: int) -> None:
    """Write each rank's heads of `whole` (rank 0's; None elsewhere) into its blocks."""
    cache = kv_caches[0]
    _, _, _, block_size, head_dim = cache.shape
    if tp.world_size > 1:
        if whole is None:
            whole = torch.empty(len(kv_caches), 2, len(block_ids), num_kv_heads, block_size,
                                head_dim, dtype=cache.dtype, device=cache.device)
        dist.broadcast(storage(whole), src=0, group=tp.group)
    first, local, _ = _heads(num_kv_heads, tp)
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    for layer, c in enumerate(kv_caches):
        storage(c).index_copy_(1, idx, storage(whole[layer, :, :, first:first + local]))


class ShardedKVBlocks:
    """Rank 0's whole-headed view of the ranks' KV caches (the core thread's only)."""

    def __init__(self, kv_caches: list[torch.Tensor], tp: TPGroup, workers,
                 num_kv_heads: int):
        self.kv_caches, self.tp, self.workers = kv_caches, tp, workers
        self.num_kv_heads = num_kv_heads

    @torch.inference_mode()
    def gather(self, block_ids: list[int]) -> torch.Tensor:
        self.workers.broadcast(GatherKV(block_ids))
        return gather_blocks(self.kv_caches, block_ids, self.tp, self.num_kv_heads)

    @torch.inference_mode()
    def scatter(self, block_ids: list[int], whole: torch.Tensor) -> None:
        self.workers.broadcast(ScatterKV(block_ids))
        scatter_blocks(self.kv_caches, block_ids, whole.to(self.kv_caches[0].device),
                       self.tp, self.num_kv_heads)
