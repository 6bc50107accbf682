"""The bundled default model (SmolLM2-135M-Instruct) with seeded random PEFT adapters of
rank 16 on every projection: greedy output equals transformers + PEFT's, token for token,
float32, for each adapter and for a batch mixing both with the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter, peft_greedy

from sluice.default_model import resolve_default_model
from sluice.engine.config import CacheConfig, EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.lora.config import LoRAConfig, LoRAModulePath
from sluice.engine.sampling_params import SamplingParams
from sluice.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the real default model through transformers and the engine

NEW_TOKENS = 12


def test_default_model_adapters_equal_peft(tmp_path):
    from transformers import AutoModelForCausalLM

    gguf = Path(resolve_default_model())
    tok = Tokenizer.from_path(str(gguf))
    prompt = tok.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])

    def load_base():
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                    dtype=torch.float32).eval()

    refs = {}
    for seed, name in enumerate(("sql", "poet")):
        model = make_adapter(load_base, tmp_path / name, seed=seed, rank=16, alpha=32,
                             std=0.04)
        refs[name] = peft_greedy(model, prompt, NEW_TOKENS)
        del model
    cfg = EngineConfig(model=str(gguf), served_model_name="default", dtype="float32",
                       device="cpu", cache=CacheConfig(num_blocks=64),
                       lora=LoRAConfig(max_loras=2, modules=tuple(
                           LoRAModulePath(n, str(tmp_path / n)) for n in refs)))
    llm = LLMEngine(cfg, tok)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    base = llm.generate([prompt], params)[0]
    assert refs["sql"] != base and refs["poet"] != base, "the adapters change the output"
    for name in refs:
        llm.add_request(name, prompt, params, lora_name=name)
    llm.add_request("base", prompt, params)
    out = {"sql": [], "poet": [], "base": []}
    while llm.has_unfinished():
        for o in llm.step():
            out[o.request_id] += o.new_token_ids
    assert out == {**refs, "base": base}
