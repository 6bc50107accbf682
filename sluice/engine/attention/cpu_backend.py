"""The CPU attention backend: the PyTorch backend's plan and KV writes, with attention
through the compiled paged kernel (csrc/paged_attention.c).

The kernel reads each KV block in place with an online softmax: no gathered tiles, no padded
score matrix, one call per layer. Decodes and speculative rows are one item per sequence;
prefill chunks are split into PREFILL_TILE-row items. Against the PyTorch path (one thread,
SmolLM2-135M, docs/benchmarks.md): a batch-32 decode step 72 -> 56 ms, a 400-token prefill
387 -> 303 ms (CPU flash SDPA 4.5 ms per layer, the kernel 2.3). The cache may hold fp8 (read
by the kernel, kv_quant.py). Shapes or dtypes the kernel does not take (float16, head_dim
or block_size over 256) keep the PyTorch path, as does an
install without the kernels (`kernels.ops()` returns None and the engine builds a
TorchAttentionBackend).
"""

from __future__ import annotations

import torch

from sluice.engine.attention import cpu_kernel
from sluice.engine.attention.backend import AttentionMetadata
from sluice.engine.attention.kv_quant import KVScale
from sluice.engine.attention.torch_backend import StepPlan, TorchAttentionBackend, build_plan

# Query rows per kernel work item of a prefill chunk: small enough to spread a long chunk over
# threads, large enough that each key tile, transposed once, serves many rows.
PREFILL_TILE = 64


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, ops):
        self._ops = ops  # torch.ops.sluice

    def _build_plan(self, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    dtype: torch.dtype) -> StepPlan:
        if not cpu_kernel.supports(dtype, kv_cache.dtype, kv_cache.shape[3], kv_cache.shape[4]):
            return super()._build_plan(kv_cache, meta, dtype)
        return build_plan(meta, kv_cache.shape[3], kv_cache.shape[2], blockwise=False,
                          prefill_tile=PREFILL_TILE)

    def _attend_items(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, plan: StepPlan, scale: float,
                      kv_scale: KVScale) -> None:
        if plan.blockwise is not None:
            super()._attend_items(q, out, kv_cache, meta, plan, scale, kv_scale)
            return
        items = plan.items
        cpu_kernel.paged_attention(self._ops, q.contiguous(), out, kv_cache, meta.block_tables,
                                   items.seq_rows, items.q_starts, items.q_lens, items.seq_lens,
                                   scale, kv_scale)
