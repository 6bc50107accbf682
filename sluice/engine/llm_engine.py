"""The synchronous engine: requests in, one scheduled + executed step at a time, outputs out."""

from __future__ import annotations

import logging
import time

import torch

from sluice.engine.config import EngineConfig, ModelConfig
from sluice.engine.distributed.parallel_state import (
    SINGLE,
    TPGroup,
    check_tensor_parallel,
    init_tensor_parallel,
)
from sluice.engine.distributed.workers import TPWorkers
from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.loader import read_hf_config
from sluice.engine.lora.layers import LoRAContext
from sluice.engine.lora.manager import LoRAManager
from sluice.engine.lora.peft_adapter import LoRAError
from sluice.engine.metrics import EngineMetrics
from sluice.engine.model_setup import (
    build_model_runner,
    resolve_device,
    resolve_dtype,
    uses_triton,
)
from sluice.engine.output_processor import OutputState
from sluice.engine.outputs import RequestOutput
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler
from sluice.engine.structured_output.manager import StructuredOutputManager
from sluice.tokenizer import IncrementalDetokenizer

log = logging.getLogger("sluice.engine")


class PromptTooLongError(ValueError):
    """The prompt leaves no room for output within the context / KV pool."""


class UnknownModelError(ValueError):
    """The request names a model (LoRA adapter) this engine does not serve."""


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, record_kv_events: bool = False,
                 weights=None):
        """Tensor-parallel (config.parallel): this engine is rank 0 and starts the other
        ranks' processes; `close()` stops them."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        lora_ctx = None if config.lora is None else LoRAContext(
            config.lora.max_loras, config.lora.max_lora_rank, self.device)
        self.tp, self.workers = self._start_tensor_parallel()
        self.runner = build_model_runner(config, self.device, self.dtype, self.tp,
                                         self.workers, weights, lora_ctx)
        self.model = self.runner.model
        mcfg = self.model.config
        cache = config.cache
        num_blocks = self.runner.num_blocks
        limit = config.scheduler.max_model_len or mcfg.max_position_embeddings
        self.max_model_len = min(limit, num_blocks * cache.block_size)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 record_kv_events)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.lora = None if lora_ctx is None else LoRAManager(config.lora, self.model, self.dtype)
        self.scheduler.lora = self.lora
        # (decode graphs would hold one step's adapter mapping: LoRA runs eager; a graph
        # of a tensor-parallel step would hold its collectives: those run eager too)
        if (uses_triton(config, self.device) and self.device.type == "cuda"
                and not config.enforce_eager and self.lora is None and self.workers is None):
            self.runner.enable_decode_graphs(config.scheduler.max_num_seqs, self.max_model_len,
                                             capture=True)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else mcfg.eos_token_ids)
        self.structured_output = StructuredOutputManager(tokenizer, mcfg.vocab_size,
                                                         self.eos_token_ids)
        self.metrics = EngineMetrics(config.served_model_name, cache.block_size, num_blocks,
                                     cache.enable_prefix_caching,
                                     config.lora.max_loras if config.lora else 0,
                                     cache.cache_dtype)
        self.requests: dict[str, OutputState] = {}
        self.speculator = self._make_speculator()
        self.kv_connector = self._make_kv_connector()
        log.info("KV cache: %d blocks of %d tokens (%s, %s); max_model_len %d", num_blocks,
                 cache.block_size, self.dtype, self.device, self.max_model_len)

    def _start_tensor_parallel(self) -> tuple[TPGroup, TPWorkers | None]:
        """Check the model splits, start ranks 1 .. N-1, and join their group as rank 0."""
        n = self.config.parallel.tensor_parallel_size
        if n == 1:
            return SINGLE, None
        mcfg = ModelConfig.from_hf(read_hf_config(self.config.model, self.config.load_format))
        check_tensor_parallel(mcfg.num_attention_heads, mcfg.num_key_value_heads,
                              mcfg.intermediate_size, n)
        workers = TPWorkers(self.config, torch.get_num_threads())
        log.info("tensor parallel: %d ranks (rank 0 here, workers %s)", n,
                 [p.pid for p in workers.procs])
        return init_tensor_parallel(0, n, workers.init_method, self.device,
                                    workers.shm_path), workers

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (an engine of one rank holds none)."""
        if self.workers is not None:
            self.workers.close(self.tp)
            self.workers = None

    def _make_kv_connector(self):
        """Disaggregated prefill/decode (kv_transfer/): the connector the scheduler calls."""
        if self.config.kv_transfer is None:
            return None
        from sluice.engine.kv_transfer.connector import make_connector

        sharded = None
        if self.workers is not None:
            from sluice.engine.distributed.kv_shards import ShardedKVBlocks

            sharded = ShardedKVBlocks(self.runner.kv_caches, self.tp, self.workers,
                                      self.model.config.num_key_value_heads)
        connector = make_connector(self.config.kv_transfer, self.kv, self.runner.kv_caches,
                                   self.metrics.registry, self.config.served_model_name,
                                   sharded)
        self.scheduler.kv_connector = connector
        return connector

    def _make_speculator(self):
        """Speculative decoding (spec_decode/): the proposer and who gets drafts."""
        spec = self.config.speculative
        if spec is None:
            return None
        from sluice.engine.spec_decode.proposer import build_proposer
        from sluice.engine.spec_decode.speculator import Speculator

        proposer = build_proposer(spec, self.runner, self.dtype, self.device, self.config.seed)
        self.metrics.enable_spec_decode(spec.num_speculative_tokens)
        log.info("speculative decoding: %s, %d tokens", spec.method, spec.num_speculative_tokens)
        return Speculator(spec, proposer, self.kv, self.max_model_len)

    def _append_tokens(self, state: OutputState, result, i: int, now: float):
        """Append sampling request i's emitted tokens (several when drafts were accepted)
        until one finishes it; count them; move num_computed_tokens over the accepted
        drafts, whose K/V the step wrote. Returns (new token ids, their logprobs or None)."""
        req = state.req
        tokens, logprobs = result.token_ids[i], result.logprobs[i]
        if req.spec_token_ids:
            self.metrics.on_spec_decode(len(req.spec_token_ids), result.num_accepted[i])
            req.spec_token_ids = []
        n = 0
        for token in tokens:
            state.append_token(token, self.max_model_len)
            n += 1
            if req.is_finished:
                break
        req.num_computed_tokens += n - 1
        assert req.is_finished or req.num_computed_tokens == req.num_tokens - 1, "in decode"
        self.metrics.on_token(req, now, n)
        return tokens[:n], None if logprobs[0] is None else logprobs[:n]

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora_name: str | None = None) -> None:
        """Queue a request, with the LoRA adapter `lora_name` (None: the base model);
        raises ValueError (PromptTooLongError, UnknownModelError) for invalid input."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        lora = None
        if lora_name is not None:
            lora = self.lora.registered.get(lora_name) if self.lora else None
            if lora is None:
                raise UnknownModelError(f"The model `{lora_name}` does not exist.")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {n} tokens, which leaves no room for output.")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, cache_salt,
                      arrival_time, priority, lora)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        req.grammar = self.structured_output.grammar_for(params.structured_outputs)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           params.skip_special_tokens)
        self.requests[request_id] = OutputState(req, detok)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output if it was live."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.req)
        state.req.finish("abort")
        self.metrics.on_finished(state.req, time.time())
        self.metrics.on_step(len(self.scheduler.running), len(self.scheduler.waiting),
                             self.kv.usage, 0, 0, 0)
        return state.make_output([], None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) --
    def start_lora_load(self, tag: object, name: str, path: str) -> None:
        """Read an adapter in the background; `finished_lora_loads` reports it. LoRAError
        (a ValueError) at once for a name in use or LoRA off."""
        if self.lora is None:
            raise LoRAError("LoRA is not enabled: start the engine with --enable-lora")
        self.lora.start_add(tag, name, path)

    def finished_lora_loads(self) -> list[tuple[object, str | None]]:
        """(tag, error or None) of loads that ended since the last call."""
        return [] if self.lora is None else self.lora.finished_adds(self.scheduler.running)

    def unload_lora(self, name: str) -> bool:
        """Unregister an adapter (its running requests finish with it); False if unknown."""
        return self.lora is not None and self.lora.remove(name)

    def lora_modules(self) -> dict[str, str]:
        registered = self.lora.registered.values() if self.lora else ()
        return {lora.name: lora.path for lora in registered}

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._abort_failed_loras() if self.lora is not None else []
        sched = self.scheduler.schedule()
        if sched.scheduled:
            # (the step's requests ordered by adapter slot: one segment each)
            mapping = None if self.lora is None else self.lora.prepare(sched.scheduled)
            sampling = [r for r, n in sched.scheduled
                        if r.num_computed_tokens + n - len(r.spec_token_ids) == r.num_tokens]
            tables = [self.kv.block_table(r.request_id) for r, _ in sched.scheduled]
            result = self.runner.execute(sched.scheduled, tables, sampling, mapping)
            self.scheduler.update_after_step(sched)
            now = time.time()
            for i, req in enumerate(sampling):
                state = self.requests[req.request_id]
                if req.first_token_time is None:
                    req.first_token_time = now
                outputs.append(state.make_output(*self._append_tokens(state, result, i, now)))
                if req.is_finished:
                    self.scheduler.finish(req)
                    if self.kv_connector is not None:  # a prefill leg's answer names its blocks
                        outputs[-1].kv_transfer_params = self.kv_connector.pop_output_params(
                            req.request_id)
                    del self.requests[req.request_id]
                    self.metrics.on_finished(req, now)
        if self.speculator is not None:  # drafts for the next step
            self.speculator.propose(self.scheduler.running)
        self.metrics.on_step(len(self.scheduler.running), len(self.scheduler.waiting),
                             self.kv.usage, len(sched.preempted), sched.num_prefix_queries,
                             sched.num_prefix_hits)
        if self.lora is not None:
            self.metrics.on_lora(self.scheduler.running, self.scheduler.waiting)
        return outputs

    def _abort_failed_loras(self) -> list[RequestOutput]:
        """Requests of an adapter whose files went since it was registered end as aborted."""
        failed, self.lora.failed = self.lora.failed, set()
        return [self.abort_request(rid) for rid, state in list(self.requests.items())
                if state.req.lora is not None and state.req.lora.lora_id in failed]

    # -- offline convenience ----------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Run prompts to completion; returns each request's output token ids in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id] += out.new_token_ids
        return [results[rid] for rid in ids]
