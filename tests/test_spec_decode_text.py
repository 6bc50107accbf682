"""Speculative decoding with a tokenizer: structured outputs (drafts checked against the
grammar, one bitmask row per verified position) and stop strings give the same text as
without speculation. Tiny random model with SmolLM2's tokenizer (tiny_chat_model)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from sluice.engine.config import CacheConfig, EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.structured_output.params import StructuredOutputsParams as SO
from sluice.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 6},
    "tag": {"type": "string", "enum": ["red", "green"]}}, "required": ["xs", "tag"]}
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    "early_exit": {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module")
def tok(tiny_chat_model) -> Tokenizer:
    return Tokenizer.from_path(str(tiny_chat_model))


def engine(path, tok, spec=None) -> LLMEngine:
    cfg = EngineConfig(model=str(path), served_model_name="t", dtype="float32", device="cpu",
                       cache=CacheConfig(num_blocks=256),
                       speculative=SpeculativeConfig.from_dict(spec) if spec else None)
    return LLMEngine(cfg, tok)


def texts(llm: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        llm.add_request(f"r{i}", p, sp)
    out = {f"r{i}": ["", [], None] for i in range(len(prompts))}
    while llm.has_unfinished():
        for o in llm.step():
            out[o.request_id][0] += o.new_text
            out[o.request_id][1] += o.new_token_ids
            if o.finished:
                out[o.request_id][2] = (o.finish_reason, o.stop_reason)
    assert llm.kv.num_free_blocks == llm.kv.num_blocks
    return out


def _params(tok: Tokenizer) -> list[SamplingParams]:
    so = SO(json=json.dumps(SCHEMA))
    return [
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured_outputs=so),
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=SO(regex="(ab|cd){2,9}")),
        SamplingParams(max_tokens=30, temperature=0.0, stop=("aaaaa",), ignore_eos=True,
                       logit_bias=((tok.encode("a", add_special_tokens=False)[0], 8.0),)),
        SamplingParams(max_tokens=30, temperature=0.7, seed=9, stop=("aa",), ignore_eos=True,
                       min_tokens=3, logprobs=1,
                       logit_bias=((tok.encode("a", add_special_tokens=False)[0], 6.0),)),
    ]


@pytest.mark.parametrize("method", sorted(SPECS))
def test_structured_outputs_and_stop_strings_equal_plain(method, tiny_chat_model, tok):
    prompts = [tok.encode("Give JSON: " + "true, " * 5), tok.encode("Go"),
               tok.encode("abababab cdcd"), tok.encode("x"), tok.encode("aaab")]
    params = _params(tok)
    want = texts(engine(tiny_chat_model, tok), prompts, params)
    llm = engine(tiny_chat_model, tok, SPECS[method])
    got = texts(llm, prompts, params)
    assert got == want
    assert got["r0"][0].lstrip().startswith("{")  # the grammar held (40 tokens: maybe cut)
    # greedy "a" forever: the stop string ends it at the fifth token, though the drafts
    # accepted in that step ran further; nothing after the stop is emitted
    assert got["r3"][2] == ("stop", "aaaaa") and len(got["r3"][1]) == 5 and got["r3"][0] == ""
    assert llm.metrics.spec_accepted._value.get() > 0


def test_bench_spec_mode_reports_both_engines(tiny_chat_model):
    """`sluice bench engine --mode spec`: every cell has both rates, the acceptance figures
    and the count of identical greedy outputs (float32: all of them)."""
    import argparse

    from sluice.bench.spec_decode import run_spec

    cfg = EngineConfig(model=str(tiny_chat_model), served_model_name="t", dtype="float32",
                       device="cpu", cache=CacheConfig(num_blocks=256),
                       speculative=SpeculativeConfig.from_dict(SPECS["ngram"]))
    result = run_spec(cfg, argparse.Namespace(batch_size=3, output_len=6, spec_reps=1))
    for cell in ("grounded_b1", "grounded_b3", "chat_b1", "chat_b3"):
        assert result[f"{cell}_plain_tok_s"] > 0 and result[f"{cell}_spec_tok_s"] > 0
        assert result[f"{cell}_mean_acceptance_length"] >= 1.0
        assert len(result[f"{cell}_acceptance_per_pos"]) == 3
    assert result["grounded_b1_identical_outputs"] == "4/4"
    assert result["chat_b3_identical_outputs"] == "3/3"
