"""Sampling filters, penalties, seeds and logprobs on hand-made logits."""

from __future__ import annotations

import math

import torch

from sluice.engine.request import Request
from sluice.engine.sampler import sample
from sluice.engine.sampling_params import SamplingParams


def req(params: SamplingParams, prompt=(1,), output=()) -> Request:
    r = Request("r", list(prompt), params)
    r.token_ids += list(output)
    if params.seed is not None:
        r.generator = torch.Generator().manual_seed(params.seed)
    return r


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    r = req(params)
    return {sample(logits.unsqueeze(0), [r]).token_ids[0] for _ in range(n)}


LOGITS = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])


def test_greedy_is_argmax():
    assert sample(LOGITS.unsqueeze(0), [req(SamplingParams(temperature=0))]).token_ids == [0]


def test_top_k_top_p_min_p_restrict_support():
    assert draws(LOGITS, SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # softmax(LOGITS) ~ [.64, .24, .09, ...]: top_p 0.8 keeps tokens 0 and 1.
    assert draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.8)) == {0, 1}
    # min_p 0.3: keep p >= 0.3 * 0.64 -> tokens 0 and 1.
    assert draws(LOGITS, SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1}
    assert len(draws(LOGITS, SamplingParams(temperature=1.0))) >= 4


def test_sampling_follows_the_distribution():
    r = req(SamplingParams(temperature=1.0, seed=3))
    logits = torch.tensor([[0.0, math.log(3.0)]])
    ones = sum(sample(logits, [r]).token_ids[0] for _ in range(2000))
    assert 1350 < ones < 1650  # p(1) = 0.75


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    # Token 0 was generated: frequency/presence push it below token 1.
    r = req(SamplingParams(temperature=0, frequency_penalty=0.5), output=[0])
    assert sample(logits, [r]).token_ids == [1]
    r = req(SamplingParams(temperature=0, presence_penalty=0.5), output=[0, 0])
    assert sample(logits, [r]).token_ids == [1]
    # Repetition penalty divides positive logits of seen tokens (prompt included).
    r = req(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0])
    assert sample(logits, [r]).token_ids == [1]
    r = req(SamplingParams(temperature=0))
    assert sample(logits, [r]).token_ids == [0]


def test_seed_independent_of_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=11)
    alone = [sample(logits, [req(p)]).token_ids[0]]
    a, b = req(p), req(SamplingParams(temperature=1.0, seed=99))
    mixed = sample(torch.cat([logits, logits]), [a, b]).token_ids[:1]
    assert alone == mixed


def test_logprobs_top_n():
    r = req(SamplingParams(temperature=0, logprobs=3))
    out = sample(LOGITS.unsqueeze(0), [r])
    lp = out.logprobs[0]
    expected = torch.log_softmax(LOGITS, -1)
    assert lp.token_id == 0 and abs(lp.logprob - expected[0].item()) < 1e-6
    assert [t for t, _ in lp.top] == [0, 1, 2]
    assert sample(LOGITS.unsqueeze(0), [req(SamplingParams(temperature=0))]).logprobs == [None]


def test_the_inverse_cdf_keeps_every_tail_token_reachable():
    """Near 1.0, float32 steps are ~6e-8: a cumulative sum in float32 would give most
    tokens of a long tail under a 0.9999 head token no width at all."""
    from sluice.engine.sampler import _inverse_cdf

    vocab = 8192
    probs = torch.full((1, vocab), 1e-4 / (vocab - 1), dtype=torch.float32)
    probs[0, 0] = 0.9999
    head = float(probs[0, 0].double())
    tail = float(probs[0, 1:].double().sum())
    hit = set()
    for chunk in torch.arange(vocab - 1).split(512):
        # one draw in the middle of each tail token's own share of the mass
        u = 1.0 - (head + (chunk.double() + 0.5) / (vocab - 1) * tail)
        hit.update(_inverse_cdf(probs.expand(len(chunk), -1), u.unsqueeze(1).float()).tolist())
    assert len(hit - {0}) > 0.95 * (vocab - 1)


def test_the_two_level_inverse_cdf_equals_a_full_running_sum():
    """Chunk sums then the running sum inside one chunk pick what one running sum over the
    whole row picks, for vocabularies that are not a multiple of the chunk, zeroed
    (filtered) tokens, and mass sitting in the first or last chunk only."""
    from sluice.engine.sampler import CDF_CHUNK, _inverse_cdf

    gen = torch.Generator().manual_seed(0)
    for vocab in (CDF_CHUNK - 3, CDF_CHUNK, 5 * CDF_CHUNK + 17, 49152):
        probs = torch.rand(64, vocab, generator=gen) ** 4
        probs[probs < 0.05] = 0.0  # filtered tokens
        probs[1, :] = 0.0
        probs[1, -1] = 0.5  # all mass on the very last token
        probs[2, :] = 0.0
        probs[2, :3] = 1.0  # all mass in the first chunk
        probs = probs / probs.sum(-1, keepdim=True)
        u = torch.rand(64, 1, generator=gen)
        u[0] = 0.0  # the target at the row's total
        cdf = probs.double().cumsum(-1)
        expected = torch.searchsorted(cdf, (1.0 - u.double()) * cdf[:, -1:]).squeeze(1)
        got = _inverse_cdf(probs, u)
        assert torch.equal(got, expected.clamp(max=vocab - 1)), vocab
        assert (probs.gather(1, got.unsqueeze(1)) > 0).all()
