"""Turns a scheduled step into model inputs, runs the model, and samples.

For each scheduled request the step computes tokens
token_ids[num_computed_tokens : num_computed_tokens + num_new]. Their slots
come from the block table (slot = block_table[pos // block_size] * block_size
+ pos % block_size); logits are computed only for the last row of requests
whose step reaches the end of their known tokens (they sample).
"""

from __future__ import annotations

import torch

from sluice.engine.attention.backend import AttentionMetadata
from sluice.engine.config import CacheConfig, ModelConfig
from sluice.engine.model.decoder import CausalLM
from sluice.engine.request import Request
from sluice.engine.sampler import SampleResult, sample


def num_kv_blocks(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                  device: torch.device) -> int:
    """Blocks that fit the budget: --kv-cache-memory on CPU, --gpu-memory-utilization on GPU."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    bytes_per_block = cache.block_size * cfg.kv_bytes_per_token(dtype.itemsize)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used
    else:
        budget = cache.kv_cache_memory
    num = budget // bytes_per_block
    if num < 1:
        raise ValueError(
            f"KV-cache budget of {budget} bytes holds no block of {bytes_per_block} bytes; "
            "raise --kv-cache-memory / --gpu-memory-utilization")
    return int(num)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        cfg = model.config
        self.model, self.device, self.block_size = model, device, block_size
        # One pre-allocated pool per layer: [K/V, block, offset, kv_head, head_dim].
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(cfg.num_hidden_layers)]

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], block_tables: list[list[int]],
                sampling: list[Request]) -> SampleResult:
        """Run one step; `block_tables[i]` belongs to scheduled[i]; sample for `sampling`."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        sampling_ids = {id(r) for r in sampling}
        bs = self.block_size
        for (req, num_new), table in zip(scheduled, block_tables):
            start = req.num_computed_tokens
            end = start + num_new
            assert len(table) * bs >= end, "block table too short for the step"
            input_ids += req.token_ids[start:end]
            pos = range(start, end)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if id(req) in sampling_ids:
                logit_rows.append(query_start_loc[-1] - 1)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(torch.tensor(input_ids, device=dev),
                            torch.tensor(positions, device=dev), self.kv_caches, meta)
        if not logit_rows:
            return SampleResult([], [])
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)])
        return sample(logits, sampling)
