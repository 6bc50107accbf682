"""A tensor-parallel group, as vLLM's `parallel_state`: the rank, the world size, and the
three collectives TP needs. Gloo on CPU, NCCL on CUDA (torch.distributed). A group of one
is the single-device engine: every collective is the identity, with no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup (None: a group of one)

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, "rank within the world"
        assert (self.group is None) == (self.world_size == 1), "a process group iff > 1"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, on every rank (in place)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim`, in rank order, on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """The ranks' tensors concatenated along `dim` on rank 0; None on the others."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None


    def close(self) -> None:
        """Leave the group, every rank together (gloo aborts a process that exits while
        its group is alive)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
            dist.destroy_process_group(self.group)


SINGLE = TPGroup()


def init_tensor_parallel(rank: int, world_size: int, init_method: str,
                         device: torch.device) -> TPGroup:
    """Join the workers' group (every rank calls it): gloo on CPU, NCCL on CUDA."""
    if world_size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size)
    return TPGroup(rank, world_size, dist.group.WORLD)


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator; ValueError naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size "
                         f"({denominator})")
    return numerator // denominator
