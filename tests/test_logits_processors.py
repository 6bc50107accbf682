"""allowed_token_ids, bad_words, min_tokens and logit_bias on hand-made logits, and min_tokens
and prompt logprobs through the engine (tiny random model, in-process)."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.config import CacheConfig, EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.request import Request
from sluice.engine.sampler import sample
from sluice.engine.sampling_params import SamplingParams

VOCAB = 8
EOS = 7


def req(params: SamplingParams, output=()) -> Request:
    r = Request("r", [1, 2], params, eos_token_ids=frozenset({EOS}))
    r.token_ids += list(output)
    return r


def greedy(logits: list[float], **fields) -> int:
    r = req(SamplingParams(temperature=0, **{k: v for k, v in fields.items() if k != "output"}),
            fields.get("output", ()))
    return sample(torch.tensor([logits]), [r]).token_ids[0]


FLAT = [0.0] * VOCAB


def test_logit_bias_bans_and_forces():
    logits = [3.0, 2.0, 1.0, 0, 0, 0, 0, 0]
    assert greedy(logits) == 0
    assert greedy(logits, logit_bias=((0, -100.0),)) == 1
    assert greedy(logits, logit_bias=((5, 100.0),)) == 5
    assert greedy(logits, logit_bias=((0, -1.5), (1, 0.4))) == 1  # 3 - 1.5 < 2 + 0.4


def test_allowed_token_ids_keep_only_those():
    logits = [3.0, 2.0, 1.0, 0.5, 0, 0, 0, 0]
    assert greedy(logits, allowed_token_ids=(2, 3)) == 2
    r = req(SamplingParams(temperature=1.0, allowed_token_ids=(4, 6)))
    drawn = {sample(torch.tensor([logits]), [r]).token_ids[0] for _ in range(200)}
    assert drawn == {4, 6}


def test_bad_words_ban_single_tokens_and_the_end_of_sequences():
    logits = [0, 0, 0, 5.0, 4.0, 0, 0, 0]
    assert greedy(logits, bad_words_token_ids=((3,),)) == 4
    # (6, 3): token 3 is banned only right after 6.
    assert greedy(logits, bad_words_token_ids=((6, 3),)) == 3
    assert greedy(logits, bad_words_token_ids=((6, 3),), output=[6]) == 4
    assert greedy(logits, bad_words_token_ids=((5, 6, 3),), output=[6]) == 3
    assert greedy(logits, bad_words_token_ids=((5, 6, 3),), output=[5, 6]) == 4


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = [0, 0, 0, 0, 0, 6.0, 1.0, 9.0]  # EOS (7), then stop token 5, then 6
    p = {"min_tokens": 2, "stop_token_ids": (5,)}
    assert greedy(logits, **p) == 6
    assert greedy(logits, **p, output=[1]) == 6
    assert greedy(logits, **p, output=[1, 1]) == EOS
    # With ignore_eos, EOS ends nothing, so it is not banned; stop token 5 still is.
    assert greedy(logits, **p, ignore_eos=True) == EOS
    assert greedy([0, 0, 0, 0, 0, 6.0, 1.0, 0], **p, ignore_eos=True) == 6


def test_unconstrained_rows_are_untouched_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    plain = [req(SamplingParams(temperature=0)) for _ in range(2)]
    biased = req(SamplingParams(temperature=0, logit_bias=((9, 100.0),), min_tokens=3))
    alone = sample(logits[[0, 2]].clone(), plain).token_ids
    mixed = sample(logits.clone(), [plain[0], biased, plain[1]]).token_ids
    assert [mixed[0], mixed[2]] == alone and mixed[1] == 9


@pytest.mark.parametrize("bad", [
    {"min_tokens": 5, "max_tokens": 4}, {"logit_bias": ((1, 101.0),)},
    {"logit_bias": ((-1, 1.0),)}, {"allowed_token_ids": ()}, {"bad_words_token_ids": ((),)},
    {"prompt_logprobs": 21},
])
def test_invalid_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def llm(tiny_chat_model) -> LLMEngine:
    from sluice.tokenizer import Tokenizer

    cfg = EngineConfig(model=str(tiny_chat_model), served_model_name="t", dtype="float32",
                       cache=CacheConfig(num_blocks=128))
    return LLMEngine(cfg, Tokenizer.from_path(str(tiny_chat_model)))


def test_min_tokens_holds_exactly_in_the_engine(llm):
    """EOS pushed to the top of every step: without min_tokens the output is EOS alone,
    with it exactly min_tokens tokens come first, then EOS."""
    eos = next(iter(llm.eos_token_ids))
    prompt = [5, 6, 7, 8]
    force = ((eos, 100.0),)
    assert llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0,
                                                 logit_bias=force)) == [[eos]]
    for n in (1, 7, 19):
        out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0,
                                                    logit_bias=force, min_tokens=n))[0]
        assert len(out) == n + 1 and out[-1] == eos and eos not in out[:-1]


def test_prompt_logprobs_match_the_next_token_logprobs(llm):
    """Entry p + 1 is log softmax(logits at p)[prompt[p + 1]]. The reference asks the engine
    to continue prompt[:p] with only prompt[p] allowed: raw logprobs are taken before
    allowed_token_ids applies, so the sampled token's logprob is the same quantity."""
    prompt = [11, 12, 13, 14, 15, 16, 17]
    entries = _run(llm, "plp", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                      prompt_logprobs=3)).prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        ref = _run(llm, f"ref{p}", prompt[:p], SamplingParams(
            max_tokens=1, temperature=0, logprobs=3, allowed_token_ids=(prompt[p],)))
        lp = ref.new_logprobs[0]
        e = entries[p]
        assert lp.token_id == e.token_id == prompt[p]
        assert e.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert [v for _, v in e.top] == pytest.approx([v for _, v in lp.top], abs=1e-4)
        assert e.rank >= 1 and (e.rank == 1) == (e.logprob >= e.top[0][1] - 1e-6)


def _run(llm, rid: str, prompt: list[int], params: SamplingParams):
    """The request's first output (prompt logprobs ride on it), run to completion."""
    llm.add_request(rid, prompt, params, cache_salt=rid)
    first = None
    while llm.has_unfinished():
        for out in llm.step():
            first = first or out
    return first
