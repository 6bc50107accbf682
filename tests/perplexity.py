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
