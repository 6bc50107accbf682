"""The batched LoRA delta, punica's semantics: y[t] += B[s_t] (A[s_t] x[t]) for every row t
whose request runs adapter slot s_t (none: the base model, no delta).

A layer's adapters are stacked by slot: `a` [slots, w, in] holds its parts' A matrices one
under another (e.g. q, k, v of a fused qkv_proj: w = parts x rank) and `b` [slots, w, out]
their B^T block-diagonally (part j's rank rows feed only part j's output columns; scaling
folded in). Ranks below the layer's are zero-padded, which adds nothing.

Three ways to add it, chosen per forward by its row count (`LoRAMapping.dense`) and dtype:
- on a CPU in bfloat16, up to DENSE_MAX_ROWS rows: one C call per layer (csrc/lora.c),
  each row's own slot and each part's block of B only (`CpuLoRAOps`);
- dense (a step of decodes and short chunks, at most DENSE_MAX_ROWS rows): one shrink
  of every row against every slot in use, h = x [A_0; A_1; ...]^T, the columns of other
  slots zeroed by a mask made once per forward, then one expand y += h [B_0; B_1; ...].
  Three ops per layer whatever the adapters, where a per-adapter loop costs three per
  adapter; the extra multiply-adds are (slots - 1) x (w / in) of the base layer's, little
  next to a decode step's weight reads (measured, docs/benchmarks.md);
- SGMV (longer steps): the engine orders a step's requests by slot
  (`LoRAManager.prepare`), so each slot's rows are one contiguous segment; per segment a
  shrink and an expand over views, computing only what each row needs.
On CUDA `TritonLoRAOps` runs BGMV kernels over all rows (each row reads its own slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

DENSE_MAX_ROWS = 256


@dataclass
class LoRAMapping:
    """One forward's rows by adapter slot: `segments` (slot, start, end), each slot once,
    in row order; rows outside every segment run the base model alone."""

    segments: tuple[tuple[int, int, int], ...]
    num_tokens: int
    token_slots: torch.Tensor  # [num_tokens] int32, -1 = none
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_slots(self) -> int:
        """Slots 0 .. num_slots - 1 cover every segment."""
        return 1 + max(s for s, _, _ in self.segments)

    @property
    def dense(self) -> bool:
        return self.num_tokens <= DENSE_MAX_ROWS

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_tokens, num_slots x width]: 1 where the column block is the row's slot."""
        m = self._masks.get(width)
        if m is None or m.dtype != dtype:
            block = torch.arange(self.num_slots * width, device=self.token_slots.device) // width
            m = (block[None, :] == self.token_slots[:, None]).to(dtype)
            self._masks[width] = m
        return m

    @classmethod
    def from_requests(cls, slots_and_counts: list[tuple[int, int]],
                      device: torch.device) -> LoRAMapping:
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
        flat = [slot for slot, n in slots_and_counts for _ in range(n)]
        token_slots = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
        return cls(tuple(segments), start, token_slots)


class LoRAOps(Protocol):
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 part_sizes: tuple[int, ...], mapping: LoRAMapping) -> None:
        """y [T, out] += each row's delta (a [slots, w, in], b [slots, w, out]; the parts'
        output widths, in order)."""


class TorchLoRAOps:
    def add_lora(self, y, x, a, b, part_sizes, mapping):
        if mapping.dense:
            k, w = mapping.num_slots, a.shape[1]
            h = x @ a[:k].reshape(k * w, -1).T
            h *= mapping.mask(w, h.dtype)
            y.addmm_(h, b[:k].reshape(k * w, -1))
            return
        for slot, start, end in mapping.segments:
            y[start:end].addmm_(x[start:end] @ a[slot].T, b[slot])


class CpuLoRAOps(TorchLoRAOps):
    """bfloat16 steps of the dense range: one C call per layer (csrc/lora.c, computing
    only each row's own slot and parts); other steps and dtypes: torch's paths."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def add_lora(self, y, x, a, b, part_sizes, mapping):
        if x.dtype != torch.bfloat16 or not mapping.dense:
            return super().add_lora(y, x, a, b, part_sizes, mapping)
        self.ops.lora_add(y, x, a, b, mapping.token_slots, part_sizes,
                          a.shape[1] // len(part_sizes))


def lora_ops(device: torch.device) -> LoRAOps:
    """The delta's implementation for the device: Triton kernels on CUDA; on CPU the C
    kernel where it is installed (sluice.engine._C), else torch."""
    if device.type == "cuda":
        from sluice.engine.lora.triton_ops import TritonLoRAOps

        return TritonLoRAOps()
    from sluice.engine import kernels

    ops = kernels.ops()
    return TorchLoRAOps() if ops is None else CpuLoRAOps(ops)
