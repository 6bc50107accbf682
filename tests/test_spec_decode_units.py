"""Speculative decoding, model-free parts: the config, the n-gram proposer, and the
verifier's acceptance rule (token-exact for greedy, distribution-exact for sampling)."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.request import Request
from sluice.engine.sampler import sample
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.ngram import propose_ngram
from sluice.engine.spec_decode.verify import rejection_sample, verify


# -- config ---------------------------------------------------------------------------------
def test_config_takes_vllms_shapes():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, '
                                    '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 4, 2, 5)
    assert SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    ).prompt_lookup_min == 3  # vLLM: a missing bound takes the other's value
    d = SpeculativeConfig.from_json('{"model": "/m", "num_speculative_tokens": 2}')
    assert (d.method, d.model) == ("draft_model", "/m")
    e = SpeculativeConfig.from_json('{"method": "early_exit", "num_layers": 6, '
                                    '"num_speculative_tokens": 3, "disable_by_batch_size": 8}')
    assert (e.num_layers, e.disable_by_batch_size) == (6, 8)


@pytest.mark.parametrize("text", [
    "not json", "[1]", '{"method": "ngram"}', '{"method": "eagle", "num_speculative_tokens": 2}',
    '{"method": "ngram", "num_speculative_tokens": 0}',
    '{"method": "ngram", "num_speculative_tokens": "3"}',
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
    '"prompt_lookup_max": 2}'),
    '{"method": "draft_model", "num_speculative_tokens": 3}',
    '{"method": "early_exit", "num_speculative_tokens": 3}',
    '{"method": "ngram", "num_speculative_tokens": 3, "typo": 1}',
])
def test_config_rejects_bad_input(text):
    with pytest.raises((ValueError, TypeError)):
        SpeculativeConfig.from_json(text)


# -- n-gram -----------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    seqs = [
        [1, 2, 3, 4, 5, 9, 9, 1, 2, 3],  # suffix 1 2 3 seen at 0: propose 4 5 9
        [7, 8, 1, 2, 6, 6, 3, 2, 5, 5, 2],  # suffix 2 (n=1): latest earlier 2 is at 7 -> 5 5
        [1, 2, 3],  # nothing repeats
        [4, 4, 4, 4],  # suffix 4 4 4 at 0 -> 4 (the continuation runs into the suffix)
    ]
    out = propose_ngram(seqs, [3, 2, 3, 2], nmin=1, nmax=3)
    assert out == [[4, 5, 9], [5, 5], [], [4]]


def test_ngram_prefers_longer_matches_and_respects_min():
    seq = [1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3]  # n=3 at 0 -> 7; n=2 would pick 8 (later)
    assert propose_ngram([seq], [2], nmin=1, nmax=3) == [[7, 9]]
    assert propose_ngram([seq], [2], nmin=1, nmax=2) == [[8, 1]]
    assert propose_ngram([[5, 1, 6, 1]], [2], nmin=2, nmax=3) == [[]]


def test_ngram_window_bounds_the_search():
    seq = [1, 2, 3] + [0] * 50 + [1, 2]
    assert propose_ngram([seq], [1], nmin=2, nmax=2, window=64) == [[3]]
    assert propose_ngram([seq], [1], nmin=2, nmax=2, window=16) == [[]]


# -- verification -------------------------------------------------------------------------------
def _req(params: SamplingParams, prompt=(1, 2, 3), rid="r") -> Request:
    return Request(rid, list(prompt), params)


def test_greedy_accepts_the_longest_matching_prefix():
    logits = torch.full((4, 8), -5.0)
    for row, tok in enumerate([3, 4, 6, 7]):  # target argmax per position
        logits[row, tok] = 5.0
    params = SamplingParams(temperature=0.0, max_tokens=10)
    res = verify(logits.clone(), [_req(params)], [[3, 4, 5]])
    assert res.token_ids == [[3, 4, 6]] and res.num_accepted == [2]
    res = verify(logits.clone(), [_req(params)], [[3, 4, 6]])
    assert res.token_ids == [[3, 4, 6, 7]] and res.num_accepted == [3]  # + the bonus token
    res = verify(logits.clone(), [_req(params)], [[0, 4, 6]])
    assert res.token_ids == [[3]] and res.num_accepted == [0]


def test_rows_see_the_drafts_as_history():
    """Penalties and min_tokens at position j count drafts 1..j as generated tokens."""
    logits = torch.zeros(2, 8)
    logits[:, 5] = 1.0  # 5 leads by 1.0 at both positions
    logits[:, 6] = 0.5
    params = SamplingParams(temperature=0.0, max_tokens=10, presence_penalty=2.0)
    res = verify(logits, [_req(params)], [[5]])
    # position 0: 5 wins and matches; position 1: 5 was generated (the draft): 6 wins
    assert res.token_ids == [[5, 6]]
    logits = torch.zeros(2, 8)
    logits[:, 0] = 3.0  # EOS-like stop token 0 leads
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=2, stop_token_ids=[0])
    res = verify(logits, [_req(params)], [[4]])
    assert res.token_ids[0][0] != 0  # banned: no output yet, draft rejected


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def test_point_mass_drafts_keep_the_target_distribution():
    """Many verifications of the same draft: the first emitted token is distributed as
    the target's processed distribution (temperature, top-k) whatever the draft."""
    torch.manual_seed(0)
    vocab, n = 8, 20000
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=10)
    target = torch.softmax(torch.where(torch.arange(vocab) < 6, row / 0.8, float("-inf")), -1)
    for draft in (0, 3, 7):  # likely, unlikely, impossible under top-k
        counts = torch.zeros(vocab)
        reqs = [_req(params, rid=f"r{i}") for i in range(1000)]
        for _ in range(n // 1000):
            logits = row.repeat(2 * len(reqs), 1)
            res = verify(logits, reqs, [[draft]] * len(reqs))
            for toks in res.token_ids:
                counts[toks[0]] += 1
        assert _chi2_pvalue(counts, target) > 1e-3, (draft, counts)


def test_second_position_is_the_target_distribution_after_acceptance():
    torch.manual_seed(1)
    row0 = torch.tensor([3.0, 0.0, 0.0, 0.0])  # draft 0 accepted ~87 %
    row1 = torch.tensor([0.0, 1.0, 2.0, 0.5])
    params = SamplingParams(temperature=1.0, max_tokens=10)
    counts = torch.zeros(4)
    reqs = [_req(params, rid=f"r{i}") for i in range(2000)]
    for _ in range(10):
        logits = torch.stack([row0, row1]).repeat(len(reqs), 1)
        for toks in verify(logits, reqs, [[0]] * len(reqs)).token_ids:
            if len(toks) == 2:
                counts[toks[1]] += 1
    assert _chi2_pvalue(counts, torch.softmax(row1, -1)) > 1e-3, counts


def test_seeded_verification_draws_as_the_plain_sampler():
    """A seeded request emits, with drafts, the tokens it samples without them."""
    vocab, n = 16, 12
    torch.manual_seed(2)
    rows = torch.randn(n + 3, vocab) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20)
    plain_req = _req(params)
    plain_req.generator = torch.Generator().manual_seed(7)
    plain = []
    for j in range(n + 3):
        tok = sample(rows[j:j + 1].clone(), [plain_req]).token_ids[0]
        plain.append(tok)
        plain_req.token_ids.append(tok)
    spec_req = _req(params)
    spec_req.generator = torch.Generator().manual_seed(7)
    got: list[int] = []
    while len(got) < n:
        pos = len(got)
        drafts = [plain[pos], plain[pos + 1], (plain[pos + 2] + 1) % vocab]  # the last is wrong
        res = verify(rows[pos:pos + 4].clone(), [spec_req], [drafts])
        assert res.num_accepted == [2]
        got += res.token_ids[0]
        spec_req.token_ids += res.token_ids[0]
    assert got == plain[:len(got)]


def test_general_rejection_sampling_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    counts = torch.zeros(5)
    accepted = 0
    for _ in range(20000):
        draft = int(torch.multinomial(q, 1, generator=gen))
        ok, tok = rejection_sample(p, q, draft, gen)
        accepted += ok
        counts[tok] += 1
    assert _chi2_pvalue(counts, p) > 1e-3, counts
    assert abs(accepted / 20000 - float(torch.minimum(p, q).sum())) < 0.02  # sum min(p, q)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from sluice.engine.cli import add_arguments, engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "tiny-llama", "--load-format", "dummy", "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_config(args).speculative == SpeculativeConfig("ngram", 2, 1, 4)
    with pytest.raises(SystemExit):  # argparse's error: exit 2 with the reason
        p.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert engine_config(p.parse_args(["--model", "tiny-llama", "--load-format", "dummy"])
                         ).speculative is None


def test_verify_with_draft_distributions_keeps_the_target_distribution():
    """Drafts sampled from q (req.spec_draft_probs): verify applies min(1, p/q) and the
    residual; both emitted positions follow the target (chi-square), and the acceptance
    rate is sum(min(p, q))."""
    torch.manual_seed(4)
    row0 = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    row1 = torch.tensor([0.0, 1.5, 0.5, 0.0, -1.0, 1.0])
    q = torch.tensor([0.05, 0.4, 0.3, 0.1, 0.1, 0.05])
    params = SamplingParams(temperature=1.0, max_tokens=10)
    p0, p1 = torch.softmax(row0, -1), torch.softmax(row1, -1)
    first, second, accepted, n = torch.zeros(6), torch.zeros(6), 0, 0
    for _ in range(8):
        reqs = [_req(params, rid=f"r{i}") for i in range(1500)]
        drafts = torch.multinomial(q, len(reqs), replacement=True).tolist()
        for r in reqs:
            r.spec_draft_probs = q.unsqueeze(0)
        logits = torch.stack([row0, row1]).repeat(len(reqs), 1)
        res = verify(logits, reqs, [[d] for d in drafts])
        for toks in res.token_ids:
            first[toks[0]] += 1
            if len(toks) == 2:
                second[toks[1]] += 1
        accepted += sum(res.num_accepted)
        n += len(reqs)
    assert _chi2_pvalue(first, p0) > 1e-3, first
    assert _chi2_pvalue(second, p1) > 1e-3, second  # the bonus after an acceptance
    assert abs(accepted / n - float(torch.minimum(p0, q).sum())) < 0.02
