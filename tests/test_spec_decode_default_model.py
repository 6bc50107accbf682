"""Speculative decoding on the real default model (SmolLM2-135M): greedy output with n-gram
and with early exit equals the output without speculation, token for token, on an
input-grounded prompt (where n-gram drafts are accepted) and an open one."""

from __future__ import annotations

import pytest

from sluice.default_model import resolve_default_model
from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the real default model (135M) through the engine, three times

CODE = "def add(a, b):\n    total = a + b\n    return total\n"
PROMPTS = ["Repeat this code exactly:\n" + CODE,
           ("Copy the following sentence: The quick brown fox jumps over the lazy dog near the "
           "river bank."),
           "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def setup():
    path = resolve_default_model()
    tok = Tokenizer.from_path(path)
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in PROMPTS]
    return path, tok, prompts


def run(path, tok, prompts, spec):
    cfg = EngineConfig(model=path, served_model_name="default", dtype="float32", device="cpu",
                       cache=CacheConfig(num_blocks=128),
                       scheduler=SchedulerConfig(max_num_batched_tokens=256),
                       speculative=SpeculativeConfig.from_dict(spec) if spec else None)
    llm = LLMEngine(cfg, tok)
    out = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))
    assert llm.kv.num_free_blocks == llm.kv.num_blocks
    return out, llm.metrics


def test_ngram_and_early_exit_equal_plain_on_the_default_model(setup):
    path, tok, prompts = setup
    want, _ = run(path, tok, prompts, None)
    got, m = run(path, tok, prompts, {"method": "ngram", "num_speculative_tokens": 4,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    assert got == want
    assert m.spec_accepted._value.get() > 10, "the answers copy the prompt"
    got, m = run(path, tok, prompts, {"method": "early_exit", "num_layers": 15,
                                      "num_speculative_tokens": 2})
    assert got == want
    assert m.spec_draft_tokens._value.get() > 0
