"""Structured outputs in the engine: compiled once per distinct constraint, masks applied in
the sampler for constrained rows only, and mixed batches that change nothing for anyone.

Runs in-process on the tiny random model with SmolLM2's tokenizer (tiny_chat_model):
random weights put no thumb on the scale, so only the grammar can make output match.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

pytest.importorskip("xgrammar")

from sluice.engine.config import CacheConfig, EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.request import Request
from sluice.engine.sampler import sample
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured_output.manager import (
    InvalidGrammarError,
    StructuredOutputManager,
)
from sluice.engine.structured_output.params import StructuredOutputsParams as SO
from sluice.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"type": "string", "enum": ["red", "green"]},
    "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["n", "tag", "xs"]}


@pytest.fixture(scope="module")
def tok(tiny_chat_model) -> Tokenizer:
    return Tokenizer.from_path(str(tiny_chat_model))


@pytest.fixture(scope="module")
def llm(tiny_chat_model, tok) -> LLMEngine:
    cfg = EngineConfig(model=str(tiny_chat_model), served_model_name="t",
                       cache=CacheConfig(num_blocks=256))
    return LLMEngine(cfg, tok)


@pytest.fixture()
def manager(tok) -> StructuredOutputManager:
    return StructuredOutputManager(tok, tok.vocab_size, tok.eos_token_ids)


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="non-empty"):
        SO(choice=())
    assert SO.from_schema({"b": 1, "a": 2}).json == '{"b":1,"a":2}'  # key order kept
    assert SO(choice=("a",)).key != SO(regex="a").key


def test_each_distinct_constraint_compiles_once(manager):
    for _ in range(3):
        manager.compile(SO.from_schema(SCHEMA))
        manager.compile(SO(regex=r"\d+"))
    assert manager.num_compiled == 2
    manager.compile(SO.from_schema(SCHEMA, disable_any_whitespace=True))
    assert manager.num_compiled == 3


def test_concurrent_requests_for_one_constraint_compile_it_once(manager):
    schema = SO.from_schema({"type": "array", "items": {"type": "string"}})
    results = []
    threads = [threading.Thread(target=lambda: results.append(manager.compile(schema)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len({id(r) for r in results}) == 1
    assert manager.num_compiled == 1


def test_cache_is_bounded(tok):
    small = StructuredOutputManager(tok, tok.vocab_size, tok.eos_token_ids, max_cached=2)
    for r in ("a", "b", "c", "a"):
        small.compile(SO(regex=r))
    assert small.num_compiled == 4  # "a" was evicted by "c"


@pytest.mark.parametrize("params,words", [
    (SO.from_schema({"type": "strin"}), ["JSON schema", "strin"]),
    (SO.from_schema({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
     ["JSON schema", "nope"]),
    (SO(json="{not json"), ["JSON schema"]),
    (SO(regex="a(b"), ["regex", "parenthesis"]),
    (SO(grammar='root ::= "a" |'), ["grammar"]),
    (SO(grammar='start ::= "a"'), ["grammar", "root"]),
])
def test_invalid_constraints_name_the_problem(manager, params, words):
    with pytest.raises(InvalidGrammarError) as err:
        manager.compile(params)
    message = str(err.value)
    assert all(w in message for w in words), message
    assert "/project/" not in message and ".cc:" not in message  # no C++ source paths
    assert manager.num_compiled == 1  # failures are not cached...
    with pytest.raises(InvalidGrammarError):
        manager.compile(params)
    assert manager.num_compiled == 2  # ...so each try compiles (and fails) again


def test_no_tokenizer_no_constraints():
    with pytest.raises(InvalidGrammarError, match="tokenizer"):
        StructuredOutputManager(None, 512, frozenset({2})).compile(SO(regex="a"))


def test_validate_tokens_leaves_the_state_unchanged(manager, tok):
    """The hook a speculative proposer will use: the longest valid draft prefix."""
    grammar = manager.grammar_for(SO(regex="ab+c"))
    a, b, c = (tok.encode(x)[0] for x in "abc")
    assert grammar.validate_tokens([a, b, b, a, c]) == [a, b, b]
    assert grammar.num_accepted == 0
    assert grammar.accept_token(a) and grammar.validate_tokens([c]) == []
    assert grammar.validate_tokens([b, c]) == [b, c]
    grammar.accept_token(b)
    grammar.rollback(2)
    assert grammar.num_accepted == 0 and grammar.validate_tokens([a]) == [a]


def _req(params: SamplingParams, grammar=None) -> Request:
    r = Request("r", [1], params)
    r.grammar = grammar
    return r


def test_sampler_masks_only_constrained_rows(manager, tok):
    """Random logits, random sampling: the constrained row still spells the regex, and the
    unconstrained rows sample exactly what they sample without it in the batch."""
    gen = torch.Generator().manual_seed(0)
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5)
    grammar = manager.grammar_for(SO(regex="[0-9]{4}"))
    free_a, free_b = _req(greedy), _req(seeded)
    free_b.generator = torch.Generator().manual_seed(5)
    alone_b = _req(seeded)
    alone_b.generator = torch.Generator().manual_seed(5)
    constrained = _req(SamplingParams(temperature=1.0), grammar)
    digits = []
    for _ in range(4):
        logits = torch.randn(3, tok.vocab_size, generator=gen)
        alone = sample(logits[[0, 2]].clone(), [free_a, alone_b]).token_ids
        mixed = sample(logits.clone(), [free_a, constrained, free_b]).token_ids
        assert [mixed[0], mixed[2]] == alone
        assert grammar.accept_token(mixed[1])
        digits.append(mixed[1])
    assert re.fullmatch("[0-9]{4}", tok.decode(digits))


def _constraints() -> list[SO]:
    return [SO.from_schema(SCHEMA), SO(regex=r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
            SO(choice=("alpha", "beta \"quoted\"", "gamma\nline")),
            SO(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"')]


def test_output_matches_each_constraint(llm, tok):
    prompt = tok.encode("Answer:")
    checks = [lambda t: set(json.loads(t)) == {"n", "tag", "xs"},
              lambda t: re.fullmatch(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", t),
              lambda t: t in ("alpha", "beta \"quoted\"", "gamma\nline"),
              lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t)]
    for so, check in zip(_constraints(), checks):
        out = llm.generate([prompt], SamplingParams(max_tokens=200, temperature=1.0, seed=3,
                                                    structured_outputs=so))[0]
        assert out[-1] in tok.eos_token_ids, "the grammar ended the output, not the length"
        text = tok.decode(out[:-1])
        assert check(text), (so.kind, text)
    # Any object: a random model's keys never end, so only the start is checked here
    # (test_engine_structured_default_model.py parses whole objects from the real model).
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, structured_outputs=(
        SO(json_object=True, disable_any_whitespace=True))))[0]
    assert tok.decode(out).startswith('{"')


def test_mixed_batch_gives_each_request_its_tokens_alone(llm, tok):
    """Greedy: constrained and unconstrained requests batched together produce the same
    tokens as when each runs alone."""
    prompts = [tok.encode(p) for p in ("One", "Two three", "Four five six", "Seven")]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=300, temperature=0, structured_outputs=_constraints()[0]),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=60, temperature=0, structured_outputs=_constraints()[1])]
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert together == alone
    assert len(together[0]) == 24 and together[1][-1] in tok.eos_token_ids


def test_cpu_mask_equals_xgrammars_kernel():
    """The numpy bias path gives exactly xgrammar's own result: -inf where a bit is clear,
    the logit untouched elsewhere, rows outside the grammar rows untouched."""
    import xgrammar as xgr

    from sluice.engine.structured_output.bitmask import _add_mask_bias

    gen = torch.Generator().manual_seed(1)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(6, vocab, generator=gen)
    logits[0, 3] = float("-inf")
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, 32), dtype=torch.int32, generator=gen)
    bitmask[2] = -1  # an unconstrained row inside the span: all ones
    rows = [1, 3, 4]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=rows)
    got = logits.clone()
    _add_mask_bias(got[1:5], bitmask[1:5])
    assert torch.equal(got, expected)
