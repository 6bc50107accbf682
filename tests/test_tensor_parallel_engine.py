"""Tensor parallelism end to end: an engine whose model is split over N ranks (worker
processes in a gloo group, CPU) emits the same tokens as one rank, holds 1/N of the
weights per rank, refuses a model that does not split, and ends when a worker dies."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from sluice.default_model import resolve_default_model
from sluice.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig
from tests.engine_server import EngineProcess
from tests.test_engine_core import _core_of, _gone

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7] * 3]


def _config(model: str, tp: int, **kw) -> EngineConfig:
    kw.setdefault("cache", CacheConfig(num_blocks=64, block_size=4))
    return EngineConfig(model=model, served_model_name="m", dtype="float32",
                        load_format=kw.pop("load_format", "dummy"),
                        parallel=ParallelConfig(tp), **kw)


def _generate(config: EngineConfig, prompts, params=GREEDY, inspect=None):
    engine = LLMEngine(config)
    try:
        out = engine.generate(prompts, params)
        return out if inspect is None else (out, inspect(engine))
    finally:
        engine.close()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_two_ranks_emit_what_one_rank_emits(model):
    """tiny-qwen3 has one KV head: both ranks hold it (replicated, vLLM's rule)."""
    assert _generate(_config(model, 2), PROMPTS) == _generate(_config(model, 1), PROMPTS)


def test_two_ranks_with_an_fp8_cache_emit_what_one_rank_emits():
    fp8 = CacheConfig(num_blocks=64, block_size=4, cache_dtype="fp8")
    two, one = (_config("tiny-llama", n, cache=fp8) for n in (2, 1))
    assert _generate(two, PROMPTS) == _generate(one, PROMPTS)


def test_the_default_model_over_three_ranks_emits_what_one_rank_emits():
    """SmolLM2-135M has 9 heads and 3 KV heads: it splits over 3 ranks, not 2."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 314, 216, 34, 1232, 216, 34]]
    one, three = (_config(resolve_default_model(), n, load_format="auto") for n in (1, 3))
    assert _generate(three, prompts) == _generate(one, prompts)


def test_structured_outputs_and_prompt_logprobs_over_two_ranks(tiny_chat_model):
    """A safetensors folder (each rank reads its slices) with a real tokenizer: grammars
    mask rank 0's logits, and prompt logprobs come from the ranks' gathered LM head."""
    pytest.importorskip("xgrammar")
    from sluice.engine.structured_output.params import StructuredOutputsParams
    from sluice.tokenizer import Tokenizer

    tok = Tokenizer.from_path(str(tiny_chat_model))
    schema = {"type": "object", "properties": {"tag": {"enum": ["red", "green"]}},
              "required": ["tag"]}
    params = [SamplingParams(max_tokens=20, temperature=0.0, prompt_logprobs=2),
              SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=(
                  StructuredOutputsParams(json=json.dumps(schema)))),
              SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=(
                  StructuredOutputsParams(regex="(ab|cd){2,5}")))]
    prompts = [tok.encode("Name a colour, in JSON:")] * 3

    def run(tp):
        engine = LLMEngine(_config(str(tiny_chat_model), tp, load_format="auto"), tok)
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                engine.add_request(f"r{i}", p, sp)
            out = {f"r{i}": [[], None] for i in range(3)}
            while engine.has_unfinished():
                for o in engine.step():
                    out[o.request_id][0] += o.new_token_ids
                    if o.prompt_logprobs is not None:
                        out[o.request_id][1] = o.prompt_logprobs
            return out
        finally:
            engine.close()

    one, two = run(1), run(2)
    assert {r: tokens for r, (tokens, _) in two.items()} == {
        r: tokens for r, (tokens, _) in one.items()}
    # (the all-reduces sum in another order: float32 rounding, not another distribution)
    for a, b in zip(one["r0"][1][1:], two["r0"][1][1:]):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank,
                                                               [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert json.loads(tok.decode(one["r1"][0]))["tag"] in ("red", "green")
    assert one["r0"][1] is not None and len(one["r0"][1]) == len(prompts[0])


def test_busy_steps_chunked_prefill_prefix_hits_and_preemption_match_one_rank():
    """Twelve requests sharing a prefix in a pool too small for all of them, prefills split
    over steps: the ranks meet in every kind of step the scheduler makes."""
    prefix = list(range(100, 140))
    prompts = [prefix + [i, i + 1, i + 2] for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def stats(engine):
        m = engine.metrics
        return (m.preemptions._value.get(), m.prefix_hits._value.get())

    def config(tp):
        return _config("tiny-llama", tp, cache=CacheConfig(num_blocks=40, block_size=4),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32))

    one, (preempted, hits) = _generate(config(1), prompts, params, stats)
    two, stats_two = _generate(config(2), prompts, params, stats)
    assert preempted > 0 and hits > 0, "the workload preempts and hits the prefix cache"
    assert two == one and stats_two == (preempted, hits)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
     "prompt_lookup_max": 3},
    # (the draft model runs whole on rank 0; the target's ranks verify its drafts)
    {"method": "draft_model", "model": "tiny-llama", "load_format": "dummy",
     "num_speculative_tokens": 3},
    # (each draft step runs the first layer on both ranks)
    {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 3},
], ids=["ngram", "draft_model", "early_exit"])
def test_speculation_over_two_ranks_emits_the_plain_tokens(spec):
    plain = _generate(_config("tiny-llama", 1), PROMPTS)
    config = _config("tiny-llama", 2, speculative=SpeculativeConfig.from_dict(spec))
    out, drafted = _generate(config, PROMPTS, inspect=lambda e: e.metrics.spec_draft_tokens
                             ._value.get())
    assert out == plain and drafted > 0


def test_each_rank_holds_its_share_of_the_weights():
    def param_bytes(tp):
        engine = LLMEngine(_config("tiny-llama", tp))
        try:
            norms = sum(p.numel() * p.element_size() for name, p in
                        engine.model.named_parameters() if "norm" in name)
            return sum(t.numel() * t.element_size() for t in _weights(engine.model)), norms
        finally:
            engine.close()

    (whole, norms), (shard, norms_too) = param_bytes(1), param_bytes(2)
    assert norms == norms_too > 0, "the norms are replicated"
    assert shard == (whole - norms) // 2 + norms


def _weights(model):
    """The model's weight tensors, once each (a packed linear's lives outside its
    parameters)."""
    seen = {}
    for module in model.modules():
        for t in [*module.parameters(recurse=False), getattr(module, "packed", None)]:
            if t is not None:
                seen[id(t)] = t
    return seen.values()


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"number of attention heads \(9\) is not divisible "
                                         r"by the tensor-parallel size \(2\)"):
        LLMEngine(_config(resolve_default_model(), 2, load_format="auto"))


def test_what_tensor_parallelism_does_not_serve_is_refused():
    from sluice.engine.lora.config import LoRAConfig

    with pytest.raises(ValueError, match="--enable-lora is not supported with "
                                         "--tensor-parallel-size > 1"):
        _config("tiny-llama", 2, lora=LoRAConfig())


def _two_rank_server(tmp_path) -> tuple[EngineProcess, int, int]:
    """A served two-rank engine: (the server, its engine core's pid, its worker's pid)."""
    engine = EngineProcess("--model", "tiny-llama", "--load-format", "dummy",
                           "--num-kv-blocks", "64", "--tensor-parallel-size", "2",
                           "--num-threads", "1", log_path=tmp_path / "engine.log").wait_ready()
    core = _core_of(engine.proc.pid)
    workers = _workers_of(core)
    assert len(workers) == 1, "one worker: rank 1"
    return engine, core, workers[0]


def test_a_dead_worker_ends_the_engine_with_exit_code_1(tmp_path):
    engine, core, worker = _two_rank_server(tmp_path)
    try:
        started = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        assert engine.proc.wait(timeout=30) == 1
        assert time.monotonic() - started < 10
        assert _gone(core, 5)
        log = (tmp_path / "engine.log").read_text()
        assert "tensor-parallel worker rank 1" in log and "exited with code -9" in log
    finally:
        engine.stop()


def test_a_worker_dies_with_its_engine(tmp_path):
    engine, core, worker = _two_rank_server(tmp_path)
    try:
        engine.proc.kill()
        engine.proc.wait()
        assert _gone(core, 15) and _gone(worker, 15)
    finally:
        engine.stop()


def _workers_of(core: int) -> list[int]:
    with open(f"/proc/{core}/task/{core}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    return [pid for pid in children
            if b"sluice.engine.distributed.worker" in open(f"/proc/{pid}/cmdline", "rb").read()]


@pytest.fixture(autouse=True)
def _one_thread_per_rank():
    """Each rank one thread: the ranks share this machine's cores (workers take rank 0's
    thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
