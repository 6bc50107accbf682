"""The CPU ranks' all-reduce through shared memory (csrc/shm_all_reduce.cpp), in place of
gloo's: ranks of one engine share a host, and gloo's loopback TCP took 1.2-2.0 ms per
all-reduce of a decode step's [8, 1024] activations on this project's 2-vCPU machine,
where a decode step of a 0.6B model makes 57 of them (docs/benchmarks.md).

The segment is a file in the ranks' private directory (on /dev/shm where there is one),
created by rank 0 before the workers start: `world` flag lines of 64 bytes, then two
buffers of `world` slots of SLOT_BYTES. A tensor larger than a slot goes in rounds of a
slot each. Every rank makes the same all-reduce calls in the same order (they run the
same step), so the round counts agree.
"""

from __future__ import annotations

import torch

SLOT_BYTES = 2 << 20
_FLAG_BYTES = 64


def segment_bytes(world: int) -> int:
    return world * _FLAG_BYTES + 2 * world * SLOT_BYTES


def create_segment(path: str, world: int) -> None:
    """A zeroed segment for `world` ranks (rank 0, before any rank maps it)."""
    with open(path, "wb") as f:
        f.truncate(segment_bytes(world))


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world: int):
        self.rank, self.world, self.seq = rank, world, 0
        self.segment = torch.from_file(path, shared=True, size=segment_bytes(world),
                                       dtype=torch.uint8)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place (x: contiguous, on the CPU)."""
        assert x.is_contiguous(), "all-reduce of a contiguous tensor"
        flat = x.view(-1)
        per_round = SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), per_round):
            self.seq += 1
            torch.ops.sluice.shm_all_reduce(flat[start:start + per_round], self.segment,
                                            self.rank, self.world, self.seq)
        return x
