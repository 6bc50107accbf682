"""Turns a scheduled step into model inputs, runs the model, and samples.

For each scheduled request the step computes tokens
token_ids[num_computed_tokens : num_computed_tokens + num_new]. Their slots
come from the block table (slot = block_table[pos // block_size] * block_size
+ pos % block_size); logits are computed only for the last row of requests
whose step reaches the end of their known tokens (they sample).

Speculative decoding: a decode scheduled with drafts (req.spec_token_ids) computes
its last known token followed by the drafts, num_new = 1 + len(drafts) positions,
and keeps the logits of all of them; `spec_decode.verify` turns those into the
request's accepted tokens. K/V written at rejected positions is never read: the
engine rolls num_computed_tokens back to the accepted length, and the next step
overwrites those slots.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from sluice.engine.attention.backend import AttentionMetadata, kv_cache_shape
from sluice.engine.config import CacheConfig, ModelConfig
from sluice.engine.cuda_graph import DecodeGraphRunner
from sluice.engine.lora.punica import LoRAMapping
from sluice.engine.models.causal_lm import CausalLM
from sluice.engine.prompt_logprobs import record_prompt_logprobs
from sluice.engine.request import Request
from sluice.engine.sampler import sample
from sluice.engine.spec_decode.verify import VerifyResult, verify
from sluice.engine.tensors import to_device


def num_kv_blocks(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                  device: torch.device, step_peak_bytes: int = 0) -> int:
    """Blocks that fit the budget: --kv-cache-memory on CPU; on GPU, utilization x total
    memory minus what is in use now (weights, other processes) minus a step's activation peak."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    bytes_per_block = cache.block_size * cfg.kv_bytes_per_token(dtype.itemsize)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - step_peak_bytes
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
        # One pre-allocated pool per layer, in the backends' shared layout.
        shape = kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(cfg.num_hidden_layers)]
        self.decode_graphs: DecodeGraphRunner | None = None  # set by enable_decode_graphs

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool) -> None:
        """Route decode-only steps through padded static buffers (captured as CUDA graphs)."""
        max_blocks = -(-max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphRunner(self.model, self.kv_caches, max_batch, max_blocks,
                                               self.device, capture)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], block_tables: list[list[int]],
                sampling: list[Request], lora: LoRAMapping | None = None) -> VerifyResult:
        """Run one step; `block_tables[i]` belongs to scheduled[i]; sample for `sampling`;
        `lora`: the step's rows by adapter slot (lora/punica.py).

        Returns, per sampling request, the tokens it emits (one without drafts)."""
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
            drafts = req.spec_token_ids
            assert not drafts or end == req.num_tokens + len(drafts), "drafts follow a decode"
            input_ids += req.token_ids[start:end] + drafts if drafts else req.token_ids[start:end]
            pos = range(start, end)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if id(req) in sampling_ids:
                last = query_start_loc[-1]
                logit_rows += range(last - 1 - len(drafts), last)
        graphs = self.decode_graphs
        if (graphs is not None and len(input_ids) == len(scheduled) <= graphs.max_batch):
            hidden = graphs.run(input_ids, positions, slots, seq_lens, block_tables)
        else:
            with self.model.lora.use(lora) if lora is not None else nullcontext():
                hidden = self._forward(input_ids, positions, slots, query_start_loc, seq_lens,
                                       block_tables)
        record_prompt_logprobs(self.model, hidden, scheduled, query_start_loc)
        if not logit_rows:
            return VerifyResult([], [], [])
        logits = self.model.compute_logits(hidden[to_device(logit_rows, torch.long, self.device)])
        if len(logit_rows) > len(sampling):
            return verify(logits, sampling, [r.spec_token_ids for r in sampling])
        result = sample(logits, sampling)
        return VerifyResult([[t] for t in result.token_ids], [[lp] for lp in result.logprobs],
                            [0] * len(sampling))

    def _forward(self, input_ids, positions, slots, query_start_loc, seq_lens, block_tables):
        meta = build_metadata(slots, query_start_loc, seq_lens, block_tables, self.device)
        dev = self.device
        return self.model(to_device(input_ids, torch.long, dev),
                          to_device(positions, torch.long, dev), self.kv_caches, meta)

    @torch.inference_mode()
    def profile_step_peak(self, num_tokens: int, num_logit_rows: int) -> int:
        """CUDA bytes a step of num_tokens (one sequence) plus num_logit_rows logits adds at
        peak on top of what is allocated now; run before the real KV pool is sized."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        table = list(range(-(-num_tokens // self.block_size)))
        hidden = self._forward(list(range(num_tokens)), list(range(num_tokens)),
                               list(range(num_tokens)), [0, num_tokens], [num_tokens], [table])
        rows = hidden[-1:].expand(num_logit_rows, -1)
        torch.softmax(self.model.compute_logits(rows), dim=-1)  # sampler-sized temporaries
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base


def build_metadata(slots: list[int], query_start_loc: list[int], seq_lens: list[int],
                   block_tables: list[list[int]], device: torch.device) -> AttentionMetadata:
    """A step's attention metadata from host lists (block tables padded with block 0)."""
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.long, device),
        query_start_loc=to_device(query_start_loc, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_tables=to_device(padded, torch.int32, device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
