"""Multi-LoRA in the engine: every adapter's greedy output equals transformers + PEFT's with
the same adapter (float32, token for token), alone and in batches that mix adapters and the
base model; the step's adapter cap, the LRU of loaded adapters, the prefix cache and the KV
events keep adapters apart."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy, load_hf, save_tiny_model
from lora_adapters import make_adapter, peft_greedy

from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine, UnknownModelError
from sluice.engine.lora import punica
from sluice.engine.lora.config import LoRAConfig, LoRAModulePath
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [300, 2, 44], [7] * 9]
MAX_TOKENS = 10
# Each adapter a different PEFT configuration: every target at rank 8; rsLoRA on q and v at
# rank 4; per-module alpha and rank patterns on the MLP.
ADAPTERS = {
    "all": {},
    "rslora-qv": {"use_rslora": True, "targets": ("q_proj", "v_proj"), "rank": 4},
    "patterns": {"targets": ("gate_proj", "up_proj", "down_proj", "o_proj"),
                 "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"mlp.up_proj": 3.0}},
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    """(base folder, adapter folders, reference outputs: adapter or None -> per prompt)."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = save_tiny_model(request.param, root / "base")
    folders, refs = {}, {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        folders[name] = root / name
        model = make_adapter(lambda: load_hf(base), folders[name], seed=seed, **kwargs)
        refs[name] = [peft_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    hf = load_hf(base)
    refs[None] = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert all(refs[name] != refs[None] for name in ADAPTERS), "an adapter changes nothing"
    return base, folders, refs


def engine(base, folders, num_blocks: int = 96, engine_kwargs=None, **lora) -> LLMEngine:
    modules = tuple(LoRAModulePath(name, str(path)) for name, path in folders.items())
    cfg = EngineConfig(model=str(base), served_model_name="base", dtype="float32", device="cpu",
                       cache=CacheConfig(num_blocks=num_blocks, block_size=4),
                       lora=LoRAConfig(**{"max_lora_rank": 8, **lora}, modules=modules),
                       **(engine_kwargs or {}))
    return LLMEngine(cfg)


def run(llm: LLMEngine, requests: list[tuple[str | None, int]], check=None) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(requests))]
    for rid, (name, p) in zip(ids, requests):
        llm.add_request(rid, PROMPTS[p], params, lora_name=name)
    out = {rid: [] for rid in ids}
    while llm.has_unfinished():
        for o in llm.step():
            out[o.request_id] += o.new_token_ids
        if check is not None:
            check(llm)
    return [out[rid] for rid in ids]


def test_each_adapter_alone_equals_peft(family):
    base, folders, refs = family
    llm = engine(base, folders, max_loras=1)
    for name in [*ADAPTERS, None]:
        for p in range(len(PROMPTS)):
            assert run(llm, [(name, p)]) == [refs[name][p]], (name, p)


@pytest.mark.parametrize("path", ["dense", "sgmv"])
def test_a_batch_mixing_three_adapters_and_the_base_gives_each_its_own_output(
        family, path, monkeypatch):
    base, folders, refs = family
    if path == "sgmv":  # (every step: the per-segment path long steps take)
        monkeypatch.setattr(punica, "DENSE_MAX_ROWS", 0)
    llm = engine(base, folders, max_loras=3)
    requests = [(name, p) for p in range(len(PROMPTS)) for name in [*ADAPTERS, None]]
    seen = []
    got = run(llm, requests, check=lambda e: seen.append(len(e.scheduler.running)))
    assert max(seen) == len(requests), "all ran in one batch"
    assert got == [refs[name][p] for name, p in requests]


@pytest.mark.parametrize("setup", [
    {"scheduler": SchedulerConfig(max_num_batched_tokens=8)},  # chunked prefills
    {"num_blocks": 14},  # preemptions: 3 requests of up to 29 tokens in 56 slots
    {"speculative": SpeculativeConfig("ngram", 3, prompt_lookup_max=3)},
    {"speculative": SpeculativeConfig("early_exit", 2, num_layers=1)},
], ids=["chunked-prefill", "preemption", "ngram", "early-exit"])
def test_adapters_keep_their_output_through_the_engines_other_paths(family, setup):
    base, folders, refs = family
    setup = dict(setup)
    num_blocks = setup.pop("num_blocks", 96)
    llm = engine(base, folders, num_blocks, setup, max_loras=3)
    requests = [(name, p) for p in range(len(PROMPTS)) for name in [*ADAPTERS, None]]
    assert run(llm, requests) == [refs[name][p] for name, p in requests]
    if num_blocks < 96:
        assert llm.scheduler.num_preemptions_total > 0
    if "speculative" in setup:
        assert llm.metrics.spec_accepted._value.get() > 0


def test_at_most_max_loras_adapters_run_and_none_starves(family):
    """--max-loras 1 with three adapters interleaved: every step's running requests use one
    adapter at most, and every request finishes with its own output."""
    base, folders, refs = family

    def one_adapter(llm):
        assert len({r.lora.lora_id for r in llm.scheduler.running if r.lora}) <= 1

    llm = engine(base, folders, max_loras=1)
    requests = [(name, p) for p in range(2) for name in ADAPTERS]
    assert run(llm, requests, check=one_adapter) == [refs[n][p] for n, p in requests]


def test_adapters_beyond_max_cpu_loras_are_evicted_lru_and_read_again(family):
    base, folders, refs = family

    def bounded(llm):
        assert len(llm.lora.loaded) <= 2

    llm = engine(base, folders, max_loras=1, max_cpu_loras=1)
    requests = [(name, 0) for name in [*ADAPTERS, *ADAPTERS]]
    assert run(llm, requests, check=bounded) == [refs[n][0] for n, _ in requests]
    assert len(llm.lora.loaded) == 1


def test_an_adapters_blocks_serve_no_other_adapter(family):
    """The same prompt under adapter A, again under A (hits), then under B and the base (no
    hit); each BlockStored event names its adapter."""
    base, folders, refs = family
    llm = engine(base, {k: folders[k] for k in ("all", "rslora-qv")}, max_loras=2)
    llm.kv.record_events = True
    hits = []
    for name in ("all", "all", "rslora-qv", None):
        assert run(llm, [(name, 0)]) == [refs[name][0]]
        hits.append(llm.metrics.prefix_hits._value.get())
    # (the prompt is 19 tokens: 4 full blocks of 4)
    assert hits == [0, 16, 16, 16]
    names = {ev.lora_name for ev in llm.kv.take_events() if type(ev).__name__ == "BlockStored"}
    assert names == {"all", "rslora-qv", None}


def test_unknown_adapter_is_refused():
    cfg = EngineConfig(model="tiny-llama", served_model_name="base", load_format="dummy",
                       dtype="float32", device="cpu", cache=CacheConfig(num_blocks=16))
    llm = LLMEngine(cfg)
    with pytest.raises(UnknownModelError, match="`nope` does not exist"):
        llm.add_request("r", [1, 2], SamplingParams(max_tokens=1), lora_name="nope")


@pytest.mark.parametrize("rows", [11, punica.DENSE_MAX_ROWS + 5], ids=["dense", "sgmv"])
def test_the_lora_delta_equals_a_per_row_reference_on_every_path(rows):
    """Torch's dense and SGMV paths and the Triton kernels (the interpreter here) add,
    to each row, its own slot's B (A x), and nothing to base-model rows."""
    from sluice.engine.lora.triton_ops import TritonLoRAOps

    gen = torch.Generator().manual_seed(0)
    slots, w = 3, 24
    x = torch.randn(rows, 40, generator=gen)
    a = torch.randn(slots, w, 40, generator=gen)
    b = torch.randn(slots, w, 40, generator=gen)
    y = torch.randn(rows, 40, generator=gen)
    counts = [(2, 3), (-1, 2), (0, rows - 9), (1, 4)]
    mapping = punica.LoRAMapping.from_requests(counts, x.device)
    want = y.clone()
    row_slots = [s for s, n in counts for _ in range(n)]
    for t, s in enumerate(row_slots):
        if s >= 0:
            want[t] += b[s].T @ (a[s] @ x[t])
    got = y.clone()
    punica.TorchLoRAOps().add_lora(got, x, a, b, (40,), mapping)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[3:5], y[3:5])
    if rows < 50:  # (the interpreter is slow)
        got = y.clone()
        TritonLoRAOps().add_lora(got, x, a, b, (40,), mapping)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
