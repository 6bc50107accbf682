"""The CPU attention backend: the PyTorch backend with its few-query sequences (decodes,
speculative verification) through the compiled paged decode kernel (cpu_decode.c).

The kernel reads each KV block once, in place, with an online softmax: no gathered tiles,
no padded score matrix, no per-op dispatch per layer beyond one call. Prefill chunks keep
SDPA. Shapes or dtypes the kernel does not take (float16, head_dim or block_size over 256)
fall back to the PyTorch blockwise path, as does a machine without a C compiler
(`cpu_kernel.load()` returns None and the engine builds a TorchAttentionBackend).
"""

from __future__ import annotations

import ctypes

import torch

from sluice.engine.attention import cpu_kernel
from sluice.engine.attention.backend import AttentionMetadata
from sluice.engine.attention.torch_backend import StepPlan, TorchAttentionBackend, build_plan

# Query rows per kernel work item of a prefill chunk: small enough to spread a long chunk over
# threads, large enough that each key tile, transposed once, serves many rows.
PREFILL_TILE = 64


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def _build_plan(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> StepPlan:
        if not cpu_kernel.supports(kv_cache.dtype, kv_cache.shape[3], kv_cache.shape[4]):
            return super()._build_plan(kv_cache, meta)
        return build_plan(meta, kv_cache.shape[3], kv_cache.shape[2], blockwise=False,
                          prefill_tile=PREFILL_TILE)

    def _attend_few(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, plan: StepPlan, scale: float) -> None:
        if plan.blockwise is not None:
            super()._attend_few(q, out, kv_cache, meta, plan, scale)
            return
        few = plan.few
        cpu_kernel.paged_decode(self._lib, q.contiguous(), out, kv_cache, meta.block_tables,
                                few.seq_rows, few.q_starts, few.q_lens, few.seq_lens, scale)
