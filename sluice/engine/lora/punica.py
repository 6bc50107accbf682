"""The batched LoRA delta, punica's semantics: y[t] += B[s_t] (A[s_t] x[t]) for every row t
whose request runs adapter slot s_t (none: the base model, no delta).

A layer's adapters are stacked by slot: `a` [slots, parts * rank, in] (its parts' A
matrices one under another, e.g. q, k, v of a fused qkv_proj) and `b` [slots, out, rank]
(rows of each part's B at that part's output columns, scaling folded in). Ranks below the
layer's `rank` are zero-padded, which adds nothing.

The engine orders a step's requests by slot (`LLMEngine.step`), so each slot's rows are one
contiguous segment: SGMV, a shrink and an expand per segment per part, over views, no
gather. That is the CPU path (`TorchLoRAOps`); on CUDA `TritonLoRAOps` runs the same as
two kernels over all rows (BGMV: each row reads its own slot's matrices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class LoRAMapping:
    """One forward's rows by adapter slot: `segments` (slot, start, end), each slot once,
    in row order; rows outside every segment run the base model alone."""

    segments: tuple[tuple[int, int, int], ...]
    num_tokens: int
    token_slots: torch.Tensor | None = None  # [num_tokens] int32, -1 = none (BGMV kernels)

    @classmethod
    def from_requests(cls, slots_and_counts: list[tuple[int, int]], device: torch.device,
                      per_token: bool) -> LoRAMapping:
        """Rows of consecutive requests (slot, their row count); slot -1: the base model."""
        segments: list[tuple[int, int, int]] = []
        start = 0
        for slot, n in slots_and_counts:
            if slot >= 0 and segments and segments[-1][0] == slot and segments[-1][2] == start:
                segments[-1] = (slot, segments[-1][1], start + n)
            elif slot >= 0:
                segments.append((slot, start, start + n))
            start += n
        assert len({s for s, _, _ in segments}) == len(segments), "a slot's rows are contiguous"
        token_slots = None
        if per_token:
            flat = [slot for slot, n in slots_and_counts for _ in range(n)]
            token_slots = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
        return cls(tuple(segments), start, token_slots)


class LoRAOps(Protocol):
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 parts: tuple[tuple[int, int], ...], rank: int, mapping: LoRAMapping) -> None:
        """y [T, out] += each row's delta; `parts`: (output offset, size) of each part."""


class TorchLoRAOps:
    def add_lora(self, y, x, a, b, parts, rank, mapping):
        for slot, start, end in mapping.segments:
            h = x[start:end] @ a[slot].T  # shrink: [n, parts * rank]
            for j, (off, size) in enumerate(parts):
                y[start:end, off:off + size] += h[:, j * rank:(j + 1) * rank] @ \
                    b[slot, off:off + size].T  # expand


def lora_ops(device: torch.device) -> LoRAOps:
    """The delta's implementation for the device: Triton kernels on CUDA, else torch."""
    if device.type == "cuda":
        from sluice.engine.lora.triton_ops import TritonLoRAOps

        return TritonLoRAOps()
    return TorchLoRAOps()
