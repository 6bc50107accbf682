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
from typing import TYPE_CHECKING

import torch

from sluice.engine.attention.backend import AttentionMetadata, kv_cache_shape
from sluice.engine.config import CacheConfig
from sluice.engine.cuda_graph import DecodeGraphRunner
from sluice.engine.distributed.messages import StepInput
from sluice.engine.lora.punica import LoRAMapping
from sluice.engine.models.causal_lm import CausalLM
from sluice.engine.prompt_logprobs import plan_prompt_logprobs, record
from sluice.engine.request import Request
from sluice.engine.sampler import sample
from sluice.engine.spec_decode.verify import VerifyResult, verify
from sluice.engine.tensors import to_device

if TYPE_CHECKING:
    from sluice.engine.distributed.workers import TPWorkers


def num_kv_blocks(model: CausalLM, cache: CacheConfig, cache_dtype: torch.dtype,
                  device: torch.device, step_peak_bytes: int = 0) -> int:
    """Blocks that fit this rank's budget (each rank holds its KV heads' share of every
    block) in cache_dtype (fp8: half the bytes of bf16, twice the blocks): --kv-cache-memory
    on CPU; on GPU, utilization x total memory minus what is in use now (weights, other
    processes) minus a step's activation peak."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    cfg = model.config
    bytes_per_block = (cache.block_size * 2 * cfg.num_hidden_layers * model.num_kv_heads
                       * cfg.head_dim * cache_dtype.itemsize)
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
                 device: torch.device, cache_dtype: torch.dtype,
                 workers: TPWorkers | None = None):
        """cache_dtype: the KV cache's (the model's dtype, or fp8); `workers`: the other
        tensor-parallel ranks' processes (rank 0 drives them)."""
        cfg = model.config
        self.model, self.device, self.block_size = model, device, block_size
        self.workers, self.num_blocks = workers, num_blocks
        # One pre-allocated pool per layer, in the backends' shared layout: this rank's heads.
        shape = kv_cache_shape(num_blocks, block_size, model.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=cache_dtype, device=device)
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
        step = self._step_input(scheduled, block_tables, sampling)
        chunks = plan_prompt_logprobs(scheduled, step.query_start_loc)
        step.logit_rows = [c.rows for c in chunks] + [step.logit_rows[0]]
        if self.workers is not None:
            self.workers.broadcast(step)
        with self.model.lora.use(lora) if lora is not None else nullcontext():
            *prompt_logits, logits = self.run(step)
        for chunk, chunk_logits in zip(chunks, prompt_logits):
            record(chunk, chunk_logits)
        if logits is None:
            return VerifyResult([], [], [])
        if logits.shape[0] > len(sampling):
            return verify(logits, sampling, [r.spec_token_ids for r in sampling])
        result = sample(logits, sampling)
        return VerifyResult([[t] for t in result.token_ids], [[lp] for lp in result.logprobs],
                            [0] * len(sampling))

    def _step_input(self, scheduled, block_tables, sampling) -> StepInput:
        """The step's model inputs; logit_rows holds the sampling rows only."""
        step = StepInput([], [], [], [0], [], block_tables, [[]])
        logit_rows = step.logit_rows[0]
        sampling_ids = {id(r) for r in sampling}
        bs = self.block_size
        for (req, num_new), table in zip(scheduled, block_tables):
            start = req.num_computed_tokens
            end = start + num_new
            assert len(table) * bs >= end, "block table too short for the step"
            drafts = req.spec_token_ids
            assert not drafts or end == req.num_tokens + len(drafts), "drafts follow a decode"
            step.input_ids += (req.token_ids[start:end] + drafts if drafts
                               else req.token_ids[start:end])
            pos = range(start, end)
            step.positions += pos
            step.slots += [table[p // bs] * bs + p % bs for p in pos]
            step.query_start_loc.append(step.query_start_loc[-1] + num_new)
            step.seq_lens.append(end)
            if id(req) in sampling_ids:
                last = step.query_start_loc[-1]
                logit_rows += range(last - 1 - len(drafts), last)
        return step

    def run(self, step: StepInput) -> list[torch.Tensor | None]:
        """The forward pass, then the logits of each of `step.logit_rows` (an empty set's:
        None). Every tensor-parallel rank runs it on the same step; only rank 0 gets logits,
        the others None."""
        graphs = self.decode_graphs
        if (graphs is not None and step.is_decode and not step.num_layers
                and len(step.seq_lens) <= graphs.max_batch):
            hidden = graphs.run(step.input_ids, step.positions, step.slots, step.seq_lens,
                                step.block_tables)
        else:
            hidden = self._forward(step.input_ids, step.positions, step.slots,
                                   step.query_start_loc, step.seq_lens, step.block_tables,
                                   step.num_layers)
        return [self.model.compute_logits(hidden[to_device(rows, torch.long, self.device)])
                if rows else None for rows in step.logit_rows]

    def _forward(self, input_ids, positions, slots, query_start_loc, seq_lens, block_tables,
                 num_layers: int = 0):
        meta = build_metadata(slots, query_start_loc, seq_lens, block_tables, self.device)
        dev = self.device
        return self.model(to_device(input_ids, torch.long, dev),
                          to_device(positions, torch.long, dev), self.kv_caches, meta,
                          num_layers)

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
        logits = self.model.compute_logits(rows)
        if logits is not None:  # (rank 0 of a tensor-parallel group)
            torch.softmax(logits, dim=-1)  # sampler-sized temporaries
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
