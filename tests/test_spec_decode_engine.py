"""Speculative decoding through the engine (tiny random-weight models, CPU, float32).

Each method must leave the output exactly as without speculation: greedy token for
token, and seeded sampling token for token too (the verifier draws one uniform per
emitted token from the request's generator, as the plain sampler does), with
concurrent requests, chunked prefill, prefix hits and forced preemption; KV blocks
all return to the pool and no KV event carries a draft token.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from prometheus_client import generate_latest

from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.kv_events import BlockStored

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    "early_exit": {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 3},
    # the target's own weights (same shape, same seed): every greedy draft is right
    "draft_same": {"method": "draft_model", "model": "tiny-llama", "load_format": "dummy",
                   "num_speculative_tokens": 4},
    # another random model with the same vocabulary: most drafts are wrong
    "draft_other": {"method": "draft_model", "model": "tiny-qwen2", "load_format": "dummy",
                    "num_speculative_tokens": 2},
}


def make_engine(spec: dict | None, num_blocks=512, block_size=4, budget=64, threshold=0,
                max_num_seqs=16, events=False, cache_dtype="auto") -> LLMEngine:
    cfg = EngineConfig(
        model="tiny-llama", served_model_name="t", load_format="dummy", dtype="float32",
        device="cpu", cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                        cache_dtype=cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  long_prefill_token_threshold=threshold),
        speculative=SpeculativeConfig.from_dict(spec) if spec else None)
    return LLMEngine(cfg, record_kv_events=events)


def workload(n=8, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(13)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:  # input-grounded: the output may copy these spans
            tail = tail[:6] * 3
        out.append(shared + tail if i % 2 else tail)
    return out


def run(llm: LLMEngine, prompts, params) -> dict[str, tuple[list[int], list]]:
    """request id -> (output ids, logprobs) with a step loop that checks KV invariants."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        llm.add_request(f"r{i}", p, sp)
    got: dict[str, tuple[list[int], list]] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while llm.has_unfinished():
        for out in llm.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs or [])
        llm.kv.check_invariants()
    assert llm.kv.num_free_blocks == llm.kv.num_blocks, "every block returns to the pool"
    return got


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy():
    return run(make_engine(None), workload(), GREEDY)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_plain(method, plain_greedy):
    llm = make_engine(METHODS[method])
    assert run(llm, workload(), GREEDY) == plain_greedy
    assert llm.metrics.spec_draft_tokens._value.get() > 0
    if method == "draft_same":  # drafts are the target's own greedy choices
        assert llm.metrics.spec_accepted._value.get() == llm.metrics.spec_draft_tokens._value.get()


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("method", ["ngram", "draft_same", "early_exit"])
def test_chunked_prefill_prefix_hits_and_preemption(method, cache_dtype):
    """Few blocks (preemptions), a small budget and a prefill cap (chunks), a shared
    prefix (hits): same output as the plain engine under the same pressure, with the KV
    cache in the model's dtype or in fp8 (the draft model's cache too)."""
    kw = {"num_blocks": 24, "budget": 12, "threshold": 5, "cache_dtype": cache_dtype}
    prompts = workload(10, seed=1)
    plain = make_engine(None, **kw)
    want = run(plain, prompts, GREEDY)
    llm = make_engine(METHODS[method], **kw)
    assert {c.dtype for c in llm.runner.kv_caches} == {
        torch.float8_e4m3fn if cache_dtype == "fp8" else torch.float32}
    assert run(llm, prompts, GREEDY) == want
    assert llm.scheduler.num_preemptions_total > 0
    assert llm.metrics.prefix_hits._value.get() > 0
    assert llm.metrics.spec_drafts._value.get() > 0


def _sampled_params() -> list[SamplingParams]:
    common = {"max_tokens": 18, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.7, seed=1, logit_bias=((7, 6.0),), **common),
        SamplingParams(temperature=1.0, top_k=5, seed=2, logit_bias=((9, 5.0),), logprobs=2,
                       **common),
        SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05, seed=3, presence_penalty=0.5,
                       logit_bias=((11, 6.0),), **common),
        SamplingParams(temperature=0.8, seed=4, frequency_penalty=0.3, repetition_penalty=1.2,
                       logit_bias=((13, 7.0),), **common),
        SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=(7,), max_tokens=12,
                       logit_bias=((7, 9.0), (8, 4.0)), logprobs=0),
        SamplingParams(temperature=0.6, seed=5, bad_words_token_ids=((15, 15),),
                       logit_bias=((15, 8.0),), **common),
    ]


@pytest.mark.parametrize("method", ["ngram", "draft_same", "early_exit"])
def test_seeded_sampling_equals_plain(method):
    """Penalties, top-k/p, min-p, logit_bias, bad_words, min_tokens, stop tokens and logprobs:
    the same tokens and logprobs with and without drafts."""
    prompts = workload(6, seed=2)
    params = _sampled_params()
    want = run(make_engine(None), prompts, params)
    llm = make_engine(METHODS[method])
    got = run(llm, prompts, params)
    assert [g[0] for g in got.values()] == [w[0] for w in want.values()]
    for (_, glp), (_, wlp) in zip(got.values(), want.values()):
        assert [(lp.token_id, lp.top) for lp in glp] == [(lp.token_id, lp.top) for lp in wlp] or (
            _close(glp, wlp))
    assert llm.metrics.spec_accepted._value.get() > 0


def _close(a, b) -> bool:
    return len(a) == len(b) and all(
        x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a, b))


def test_max_tokens_and_model_length_bound_the_drafts():
    llm = make_engine(METHODS["draft_same"])
    out = run(llm, [[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out["r0"][0]) == 5
    assert llm.metrics.spec_draft_tokens._value.get() <= 4  # at most max_tokens - 1 drafted


def test_accepted_drafts_save_steps():
    """A perfect draft (k = 4) emits 5 tokens per target step after the prefill."""
    llm = make_engine(METHODS["draft_same"])
    llm.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=21, temperature=0.0,
                                                      ignore_eos=True))
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    assert steps == 1 + 4  # prefill (1 token), then 4 verifications of 4 drafts + 1


def test_no_kv_event_carries_a_draft_token():
    prompts = workload(6, seed=3)
    llm = make_engine(METHODS["draft_other"], events=True)
    got = run(llm, prompts, GREEDY)
    finals = [p + got[f"r{i}"][0] for i, p in enumerate(prompts)]
    bs = llm.kv.block_size
    stored = [e for e in llm.kv.take_events() if isinstance(e, BlockStored)]
    assert stored and llm.metrics.spec_draft_tokens._value.get() > llm.metrics.spec_accepted._value.get()
    for e in stored:
        ok = any(f[i:i + len(e.token_ids)] == list(e.token_ids)
                 for f in finals for i in range(0, len(f), bs))
        assert ok, f"published block holds tokens no request kept: {e.token_ids}"


def test_disable_by_batch_size():
    prompts = workload(4, seed=4)
    on = make_engine({**METHODS["draft_same"], "disable_by_batch_size": 5})
    run(on, prompts, GREEDY)
    assert on.metrics.spec_drafts._value.get() > 0
    off = make_engine({**METHODS["draft_same"], "disable_by_batch_size": 4}, budget=512)
    same = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4
    run(off, prompts, same)  # four requests run together to the end: never below 4
    assert off.metrics.spec_drafts._value.get() == 0


def test_metrics_under_vllms_names():
    llm = make_engine(METHODS["draft_same"])
    run(llm, workload(3), GREEDY)
    text = generate_latest(llm.metrics.registry).decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert f'{name}{{model_name="t"}}' in text
    for pos in range(4):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="t",'
                f'position="{pos}"}}') in text
    m = llm.metrics
    per_pos = [m._spec_per_pos.labels("t", str(p))._value.get() for p in range(4)]
    assert sum(per_pos) == m.spec_accepted._value.get()
    assert per_pos == sorted(per_pos, reverse=True)  # position i accepted only after 0..i-1


def test_draft_model_needs_the_same_vocabulary(tmp_path):
    from sluice.engine.shapes import SHAPES

    cfg = dict(SHAPES["tiny-llama"], vocab_size=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = {"method": "draft_model", "model": str(tmp_path), "load_format": "dummy",
            "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 512"):
        make_engine(spec)


def test_early_exit_needs_fewer_layers_than_the_model():
    with pytest.raises(ValueError, match="num_layers"):
        make_engine({"method": "early_exit", "num_layers": 2, "num_speculative_tokens": 2})


def test_through_the_engine_core_process():
    """--speculative-config reaches the core process; streams carry several tokens a step."""
    import asyncio

    from sluice.engine.core.client import EngineCoreClient
    from sluice.engine.core.process import CoreSpec

    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = make_engine(None).generate([prompt], params)[0]
    config = EngineConfig(model="tiny-llama", served_model_name="t", load_format="dummy",
                          cache=CacheConfig(num_blocks=64, block_size=4),
                          speculative=SpeculativeConfig.from_dict(METHODS["draft_same"]))
    client = EngineCoreClient(CoreSpec(config, None, 1, None, "", "", "WARNING"))
    try:
        async def run():
            return [o async for o in client.generate("a", prompt, params)]

        outs = asyncio.run(run())
        assert [t for o in outs for t in o.new_token_ids] == want
        assert max(len(o.new_token_ids) for o in outs) > 1
        assert b'vllm:spec_decode_num_accepted_tokens_total{model_name="t"}' in (
            client.metrics_text())
    finally:
        client.shutdown()


def test_sampled_output_distribution_matches_the_target(tmp_path):
    """Through the whole engine, unseeded: on a 16-token vocabulary, the joint distribution
    of the first two sampled tokens with another model drafting (the second one drafted
    from the draft's own distribution q, verified by min(1, p/q) and the residual)
    matches the target's exact one, p(t1) p(t2 | t1) from its own logprobs (chi-square)."""
    import torch

    from sluice.engine.shapes import SHAPES

    vocab, temp, n = 16, 0.25, 4000
    (tmp_path / "config.json").write_text(json.dumps(dict(SHAPES["tiny-llama"], vocab_size=vocab)))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(dict(SHAPES["tiny-qwen2"], vocab_size=vocab)))
    # an unseeded sampled request: the draft samples from its own q, the general rule verifies
    spec = {"method": "draft_model", "model": str(draft), "load_format": "dummy",
            "num_speculative_tokens": 1}

    def engine(s):
        cfg = EngineConfig(model=str(tmp_path), served_model_name="t", load_format="dummy",
                           dtype="float32", device="cpu", cache=CacheConfig(block_size=4,
                                                                            num_blocks=2048),
                           scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
                           speculative=SpeculativeConfig.from_dict(s) if s else None)
        return LLMEngine(cfg)

    prompt = [1, 2, 3, 4, 5]
    exact = engine(None)
    full = SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab)
    rows = [prompt] + [prompt + [t] for t in range(vocab)]
    for i, p in enumerate(rows):
        exact.add_request(f"x{i}", p, full)
    dist = {}
    while exact.has_unfinished():
        for o in exact.step():
            lp = dict(o.new_logprobs[0].top)
            dist[o.request_id] = torch.softmax(
                torch.tensor([lp[t] for t in range(vocab)]) / temp, dim=0)
    joint = (dist["x0"].unsqueeze(1) * torch.stack([dist[f"x{t + 1}"] for t in range(vocab)]))
    torch.manual_seed(0)
    llm = engine(spec)
    counts = torch.zeros(vocab, vocab)
    for start in range(0, n, 500):
        # max_tokens 3: after t1 there is room for one draft (t2) and the bonus (t3)
        for t1, t2, _ in llm.generate([prompt] * 500, SamplingParams(
                max_tokens=3, temperature=temp, ignore_eos=True)):
            counts[t1, t2] += 1
    m = llm.metrics
    assert m.spec_accepted._value.get() > 0.1 * n, "drafts verified, a fair share accepted"
    assert m.spec_draft_tokens._value.get() > m.spec_accepted._value.get(), "and some rejected"
    probs, obs = joint.flatten(), counts.flatten()
    keep = probs * n >= 5  # chi-square's usual validity rule; pool the rare cells
    expected = torch.cat([probs[keep] * n, (probs[~keep].sum() * n).reshape(1)])
    observed = torch.cat([obs[keep], obs[~keep].sum().reshape(1)])
    stat = ((observed - expected) ** 2 / expected).sum()
    pvalue = float(torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2.0), stat / 2))
    assert pvalue > 1e-3, (stat, len(expected))


@pytest.mark.parametrize("method", ["early_exit", "draft_other"])
def test_unseeded_sampling_with_sampled_drafts_under_pressure(method):
    """Sampled drafts (q returned with them) through chunked prefill and preemption: every
    request gets its max_tokens with logprobs, blocks all come back (checked each step)."""
    llm = make_engine(METHODS[method], num_blocks=24, budget=12, threshold=5)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, ignore_eos=True,
                            logprobs=1)
    out = run(llm, workload(10, seed=1), params)
    assert all(len(ids) == 16 and len(lps) == 16 for ids, lps in out.values())
    assert llm.scheduler.num_preemptions_total > 0
    assert 0 < llm.metrics.spec_accepted._value.get() < llm.metrics.spec_draft_tokens._value.get()
