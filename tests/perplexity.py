"""The default model's perplexity of a fixed text through the engine, every token after
the first scored (prompt logprobs): tests/test_gguf_perplexity.py, test_fp8_kv_engine.py."""

from __future__ import annotations

import math
from pathlib import Path

from sluice.default_model import resolve_default_model
from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.tokenizer import Tokenizer

# The opening of Newton's Opticks, 4th edition, 1730: public domain, from Project
# Gutenberg's #33504 as Go's test data ships it; 3,354 tokens.
TEXT = Path(__file__).parent / "data" / "opticks.txt"


def perplexity(tok: Tokenizer, ids: list[int], step_tokens: int = 2048,
               cache: CacheConfig | None = None, **kw) -> float:
    """The default model's (bf16) perplexity of ids."""
    engine = LLMEngine(EngineConfig(
        model=resolve_default_model(), served_model_name="m", dtype="bfloat16",
        cache=cache or CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=step_tokens, max_model_len=8192),
        **kw), tok)
    engine.add_request("text", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    entries = None
    while engine.has_unfinished():
        for out in engine.step():
            entries = entries or out.prompt_logprobs
    logprobs = [e.logprob for e in entries[1:]]
    assert len(logprobs) == len(ids) - 1
    return math.exp(-sum(logprobs) / len(logprobs))


def teacher_forced(engine: LLMEngine, prompts: list[list[int]],
                   texts: list[list[int]]) -> tuple[int, int, list[int | None]]:
    """Each prompt with its reference text fed as prompt: at how many of the text's positions
    the engine's own argmax is the reference token (prompt logprob rank 1), out of how many,
    and the first position where it is not, per prompt."""
    agree = total = 0
    first_divergence = []
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        engine.add_request(f"forced-{i}", prompt + text,
                           SamplingParams(max_tokens=1, prompt_logprobs=0))
        entries = None
        while engine.has_unfinished():
            for out in engine.step():
                entries = entries or out.prompt_logprobs
        ranks = [e.rank for e in entries[len(prompt):]]
        agree += sum(r == 1 for r in ranks)
        total += len(ranks)
        first_divergence.append(next((j for j, r in enumerate(ranks) if r != 1), None))
    return agree, total, first_divergence
