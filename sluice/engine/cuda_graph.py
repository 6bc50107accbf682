"""Decode steps replayed from CUDA graphs.

A decode-only step (every scheduled request computes exactly one token) is
copied into static input buffers padded up to the next captured batch size
(1, 2, 4, 8, then steps of 16), and the graph captured for that size replays
the whole forward pass with one launch. Padding follows the attention
backend's contract: padded tokens have slot -1 (nothing written) and padded
sequences query length 1 with seq_len 0 (they attend to nothing). Only the
Triton backend honours that contract, so graphs are used with it only.

With capture=False the same padded static-buffer path runs eagerly: that is how
it is tested on CPU (Triton's interpreter) and what `--enforce-eager` keeps off.
"""

from __future__ import annotations

import bisect

import torch

from sluice.engine.attention.backend import AttentionMetadata
from sluice.engine.models.causal_lm import CausalLM
from sluice.engine.tensors import to_device

CAPTURE_SIZES = (1, 2, 4, 8, *range(16, 513, 16))


class DecodeGraphRunner:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], max_batch: int,
                 max_blocks_per_seq: int, device: torch.device, capture: bool):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = [s for s in CAPTURE_SIZES if s < max_batch] + [max_batch]
        size = self.sizes[-1]
        long, i32 = {"dtype": torch.long, "device": device}, {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(size, **long)
        self.positions = torch.zeros(size, **long)
        self.slot_mapping = torch.full((size,), -1, **long)
        self.seq_lens = torch.zeros(size, **i32)
        self.query_start_loc = torch.arange(size + 1, **i32)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, **i32)
        self.block_size = kv_caches[0].shape[3]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[0] * size,  # not read by the Triton backend
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                          self._meta(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            self._forward(size)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            seq_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [n, hidden] of n decode tokens (n <= max_batch)."""
        n = len(input_ids)
        assert 0 < n <= self.max_batch and len(block_tables) == n
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = max(len(t) for t in block_tables)
        assert width <= self.block_tables.shape[1], "block table wider than max_model_len"
        dev = self.input_ids.device
        self.input_ids[:n] = to_device(input_ids, torch.long, dev)
        self.positions[:n] = to_device(positions, torch.long, dev)
        self.slot_mapping[:n] = to_device(slots, torch.long, dev)
        self.seq_lens[:n] = to_device(seq_lens, torch.int32, dev)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        self.block_tables[:n, :width] = to_device(tables, torch.int32, dev)
        # Padding rows: no write, nothing to attend to (a previous step may have left values).
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        self.slot_mapping[n:size] = -1
        self.seq_lens[n:size] = 0
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]
