"""`--quantization gguf` on the bundled default model (SmolLM2-135M-Instruct, Q4_1 with a
Q8_0 embedding): the engine keeps the file's blocks (a third of the dequantized bf16
weights' bytes) and, at each position of the dequantized float32 path's own greedy text,
picks the same next token on at least 95 % of them (the activations' rounding to 8 bits
per block is the only change). Also: through the server, and what it refuses."""

from __future__ import annotations

import httpx
import pytest
from engine_server import EngineProcess
from perplexity import teacher_forced

from sluice.default_model import resolve_default_model
from sluice.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from sluice.engine.layers.gguf_linear import GGUFEmbedding, GGUFLinear
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the real default model

QUESTIONS = ["What is the capital of France?", "Write a haiku about rivers.",
             "Explain photosynthesis in two sentences.", "List three prime numbers.",
             "Who wrote Romeo and Juliet?", "How do I boil an egg?"]


def _engine(tok, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=resolve_default_model(), served_model_name="m",
                                  dtype="float32", cache=CacheConfig(num_blocks=256), **kw), tok)


@pytest.mark.parametrize("step_tokens", [4, 2048], ids=["integer dot products", "tiles"])
def test_quantized_picks_the_float32_paths_tokens_on_95_percent_of_positions(step_tokens):
    """Steps of at most 4 tokens take the integer dot products (a decode's path); a whole
    prompt in one step multiplies float32 tiles, exactly the dequantized weights."""
    tok = Tokenizer.from_path(resolve_default_model())
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    texts = _engine(tok).generate(prompts, greedy)
    quantized = _engine(tok, quantization="gguf",
                        scheduler=SchedulerConfig(max_num_batched_tokens=step_tokens))
    agree, total, first_divergence = teacher_forced(quantized, prompts, texts)
    assert total == len(QUESTIONS) * 32
    print(f"agreement {agree}/{total}; first divergence per prompt {first_divergence}")
    assert agree / total >= (0.95 if step_tokens == 4 else 1.0), (agree, total,
                                                                  first_divergence)


def test_the_blocks_are_kept_at_their_own_size():
    tok = Tokenizer.from_path(resolve_default_model())
    whole = sum(p.numel() * 2 for p in _engine(tok).model.parameters())  # as bf16
    model = _engine(tok, quantization="gguf").model
    kept = {}  # (the tied LM head reads the embedding's blocks: counted once)
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            kept.update((id(data), data) for _, data in module.runs)
        elif isinstance(module, GGUFEmbedding):
            kept[id(module.data[1])] = module.data[1]
    size = sum(t.numel() * t.element_size() for t in kept.values())
    assert size < 0.4 * whole, (size, whole)


def test_served_with_the_flag(tmp_path):
    engine = EngineProcess("--quantization", "gguf", log_path=tmp_path / "engine.log")
    try:
        engine.wait_ready()
        r = httpx.post(engine.url + "/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["text"]
    finally:
        engine.stop()


@pytest.mark.parametrize("kw, needle", [
    ({"model": "tiny-llama", "load_format": "dummy"}, "takes a .gguf model file"),
    ({"parallel": ParallelConfig(3)}, "not supported with --enable-lora or --tensor-parallel"),
])
def test_what_it_refuses(kw, needle):
    base = {"model": resolve_default_model(), "served_model_name": "m"}
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**{**base, **kw}, quantization="gguf")
