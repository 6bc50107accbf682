"""A tensor-parallel group, as vLLM's `parallel_state`: the rank, the world size, and the
three collectives TP needs. Gloo on CPU, NCCL on CUDA (torch.distributed); on CPU the
all-reduce, a layer's collective, goes through shared memory where the engine's kernels
are installed (shm_all_reduce.py). A group of one is the single-device engine: every
collective is the identity, with no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sluice.engine import kernels
from sluice.engine.distributed.shm_all_reduce import ShmAllReduce


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup (None: a group of one)
    shm: ShmAllReduce | None = None  # CPU ranks: the shared-memory all-reduce

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, "rank within the world"
        assert (self.group is None) == (self.world_size == 1), "a process group iff > 1"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, on every rank (in place)."""
        if self.shm is not None and x.device.type == "cpu":
            return self.shm.all_reduce(x)
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

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values, on every rank."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def close(self) -> None:
        """Leave the group, every rank together (gloo aborts a process that exits while
        its group is alive)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
            dist.destroy_process_group(self.group)


SINGLE = TPGroup()


def init_tensor_parallel(rank: int, world_size: int, init_method: str,
                         device: torch.device, shm_path: str | None = None) -> TPGroup:
    """Join the workers' group (every rank calls it): gloo on CPU, NCCL on CUDA; on CPU,
    with the shared-memory all-reduce over the segment at `shm_path` (create_segment)
    where the engine's kernels are installed."""
    if world_size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # (NCCL binds a rank's communicator to the current device)
        torch.cuda.set_device(device)
    # (the ranks share a pod or a machine: gloo's peers meet on loopback, not on the
    # interface the host name resolves to)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size)
    shm = None
    if device.type == "cpu" and shm_path is not None and kernels.ops() is not None:
        shm = ShmAllReduce(shm_path, rank, world_size)
    return TPGroup(rank, world_size, dist.group.WORLD, shm)


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int,
                          size: int) -> None:
    """ValueError, naming the sizes, unless the model splits over `size` ranks: heads and
    the MLP evenly, KV heads evenly or replicated (size a multiple of them)."""
    divide(num_heads, size, "the number of attention heads")
    kv_replicas(num_kv_heads, size)
    divide(intermediate_size, size, "the MLP's intermediate size")


def kv_replicas(num_kv_heads: int, size: int) -> int:
    """Ranks that hold each KV head: 1 when the heads split evenly over the ranks; with
    fewer heads than ranks, size / heads (ValueError unless size is a multiple of them)."""
    if num_kv_heads >= size:
        divide(num_kv_heads, size, "the number of key/value heads")
        return 1
    if size % num_kv_heads:
        raise ValueError(f"the tensor-parallel size ({size}) exceeds the number of key/value "
                         f"heads ({num_kv_heads}) and is not a multiple of it")
    return size // num_kv_heads


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator; ValueError naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size "
                         f"({denominator})")
    return numerator // denominator
