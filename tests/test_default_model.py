"""The bundled default model (SmolLM2-135M-Instruct GGUF) loads offline and answers sensibly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.default_model import resolve_default_model
from sluice.engine.config import CacheConfig, EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the real default model (135M) through the engine


@pytest.fixture(scope="module")
def default_engine():
    path = resolve_default_model()
    tok = Tokenizer.from_path(path)
    cfg = EngineConfig(model=path, served_model_name="default", dtype="float32", device="cpu",
                       cache=CacheConfig(num_blocks=128))
    return LLMEngine(cfg, tok), tok


def test_answers_capital_of_france(default_engine):
    llm, tok = default_engine
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    llm.add_request("q", ids, SamplingParams(max_tokens=24, temperature=0))
    text = ""
    while llm.has_unfinished():
        for out in llm.step():
            text += out.new_text
    assert "Paris" in text, text


def test_greedy_equals_transformers_on_default_weights(default_engine):
    from transformers import AutoModelForCausalLM

    llm, tok = default_engine
    gguf = Path(resolve_default_model())
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    ids = tok.encode_chat([{"role": "user", "content": "Write a haiku about rivers."}])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          min_new_tokens=16, eos_token_id=None, pad_token_id=0)
    got = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert got == ref[0, len(ids):].tolist()
