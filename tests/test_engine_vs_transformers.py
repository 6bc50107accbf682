"""Greedy outputs equal Hugging Face transformers token for token (float32, same weights)."""

from __future__ import annotations

import random

import pytest
from hf_models import FAMILIES, hf_greedy, load_hf

from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_engine(folder, **kw) -> LLMEngine:
    cache = CacheConfig(block_size=kw.pop("block_size", 16), num_blocks=kw.pop("num_blocks", 256),
                        enable_prefix_caching=kw.pop("prefix_caching", True))
    sched = SchedulerConfig(max_num_batched_tokens=kw.pop("budget", 2048),
                            max_num_seqs=kw.pop("max_num_seqs", 64),
                            long_prefill_token_threshold=kw.pop("threshold", 0))
    assert not kw
    return LLMEngine(EngineConfig(model=str(folder), served_model_name="tiny", dtype="float32",
                                  device="cpu", cache=cache, scheduler=sched))


def prompts(n: int, seed: int, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_models):
    """family -> (folder, hf model, cache of prompt -> hf greedy output)."""
    return {f: (tiny_models[f], load_hf(tiny_models[f]), {}) for f in FAMILIES}


def expected(ref, prompt):
    _, model, cache = ref
    key = tuple(prompt)
    if key not in cache:
        cache[key] = hf_greedy(model, prompt, GREEDY.max_tokens)
    return cache[key]


@pytest.mark.parametrize("family", FAMILIES)
def test_single_requests(family, reference):
    ref = reference[family]
    engine = make_engine(ref[0])
    for prompt in prompts(3, seed=1):
        assert engine.generate([prompt], GREEDY)[0] == expected(ref, prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_different_lengths(family, reference):
    ref = reference[family]
    batch = prompts(6, seed=2)
    got = make_engine(ref[0]).generate(batch, GREEDY)
    assert got == [expected(ref, p) for p in batch]


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill(family, reference):
    ref = reference[family]
    batch = prompts(4, seed=3, lo=40, hi=90)
    engine = make_engine(ref[0], budget=24, block_size=8)  # every prompt spans several chunks
    got = engine.generate(batch, GREEDY)
    assert got == [expected(ref, p) for p in batch]


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption(family, reference):
    ref = reference[family]
    batch = prompts(6, seed=4, lo=20, hi=40)
    engine = make_engine(ref[0], block_size=4, num_blocks=40)  # 160 slots for ~6 x 42 tokens
    got = engine.generate(batch, GREEDY)
    assert engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    assert got == [expected(ref, p) for p in batch]
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits(family, reference):
    ref = reference[family]
    shared = prompts(1, seed=5, lo=40, hi=40)[0]
    batch = [shared + tail for tail in prompts(4, seed=6, lo=1, hi=9)]
    engine = make_engine(ref[0], block_size=8)
    first = engine.generate(batch[:1], GREEDY)
    rest = engine.generate(batch[1:], GREEDY)
    assert first + rest == [expected(ref, p) for p in batch]
    hits = engine.metrics.prefix_hits._value.get()
    assert hits >= 3 * 40, f"expected the shared 40-token prefix to hit, got {hits} hit tokens"
    # The exact same prompt again: everything but the last token comes from the cache.
    again = engine.generate(batch[:1], GREEDY)
    assert again == first


@pytest.mark.parametrize("family", FAMILIES)
def test_a_burst_of_one_prefix_during_its_chunked_prefill(family, reference):
    # Sent together, prefilled 8 tokens a step: the others wait for the first one's
    # prefix and hit all of it, from the step that writes its last block on.
    ref = reference[family]
    shared = prompts(1, seed=7, lo=40, hi=40)[0]
    batch = [shared + tail for tail in prompts(4, seed=8, lo=1, hi=9)]
    engine = make_engine(ref[0], block_size=8, budget=64, threshold=8)
    assert engine.generate(batch, GREEDY) == [expected(ref, p) for p in batch]
    assert engine.metrics.prefix_hits._value.get() == 3 * 40


def test_prefix_caching_disabled_still_correct(reference):
    ref = reference["llama"]
    batch = prompts(3, seed=7)
    engine = make_engine(ref[0], prefix_caching=False)
    assert engine.generate(batch + batch, GREEDY) == [expected(ref, p) for p in batch + batch]
    assert engine.metrics.prefix_hits._value.get() == 0


def test_sharded_checkpoint(reference, tmp_path):
    """A checkpoint split over several safetensors files loads to the same model."""
    _folder, model, _ = reference["qwen2"]
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="200KB")
    shards = list(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2
    batch = prompts(2, seed=8)
    assert make_engine(tmp_path).generate(batch, GREEDY) == [expected(reference["qwen2"], p)
                                                           for p in batch]
