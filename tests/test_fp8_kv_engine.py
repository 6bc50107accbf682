"""`--kv-cache-dtype fp8` through the engine: twice the blocks in the same memory, the default
model's greedy choices kept, its perplexity close to a bf16 cache's, checkpoint scales
read, and P/D transfer between fp8 engines (refused, with a local prefill, towards an
engine whose cache differs). Prefix hits, preemption and speculative decoding with an fp8
cache: tests/test_spec_decode_engine.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from engine_server import EngineProcess
from perplexity import perplexity, teacher_forced
from prometheus_client import generate_latest

from sluice.default_model import resolve_default_model
from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the real default model, engine processes

QUESTIONS = ["What is the capital of France?", "Write a haiku about rivers.",
             "Explain photosynthesis in two sentences.", "List three prime numbers.",
             "Who wrote Romeo and Juliet?", "How do I boil an egg?"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(resolve_default_model())


def _engine(tok, cache_dtype: str, dtype: str = "float32", **cache) -> LLMEngine:
    cache.setdefault("num_blocks", 256)
    return LLMEngine(EngineConfig(model=resolve_default_model(), served_model_name="m",
                                  dtype=dtype, cache=CacheConfig(cache_dtype=cache_dtype,
                                                                 **cache)), tok)


def test_fp8_holds_twice_the_blocks_of_the_same_memory(tok):
    blocks = {}
    for name in ("auto", "fp8"):
        engine = _engine(tok, name, "bfloat16", num_blocks=None, kv_cache_memory=64 << 20)
        blocks[name] = engine.runner.num_blocks
        assert {c.dtype for c in engine.runner.kv_caches} == {
            torch.float8_e4m3fn if name == "fp8" else torch.bfloat16}
        info = generate_latest(engine.metrics.registry).decode()
        assert f'cache_dtype="{name}"' in info and f'num_gpu_blocks="{blocks[name]}"' in info
    # 64 MiB / (16 tokens x 2 x 30 layers x 3 KV heads x 64 dims x bytes per value)
    assert blocks == {"auto": 182, "fp8": 364}


def test_fp8_picks_the_model_dtype_caches_tokens_on_90_percent_of_positions(tok):
    """At each position of the model-dtype cache's own greedy text (float32), teacher-forced
    in steps of 4 tokens so every step reads the cache as a decode does. Measured 181/192
    (94.3 %), first divergences at 26, 8, 12, 3, 13, 6: e4m3 keeps 3 bits of mantissa
    (relative rounding up to 1/16), and layer 0's values are small (43 % of them below
    e4m3's smallest normal at scale 1)."""
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    texts = _engine(tok, "auto").generate(prompts, greedy)
    fp8 = LLMEngine(EngineConfig(
        model=resolve_default_model(), served_model_name="m", dtype="float32",
        cache=CacheConfig(num_blocks=256, cache_dtype="fp8"),
        scheduler=SchedulerConfig(max_num_batched_tokens=4)), tok)
    agree, total, first_divergence = teacher_forced(fp8, prompts, texts)
    print(f"agreement {agree}/{total}; first divergence per prompt {first_divergence}")
    assert total == len(QUESTIONS) * 32 and agree / total >= 0.9, (agree, first_divergence)


def test_fp8_perplexity_is_close_to_the_model_dtype_caches(opticks):
    """The shipped text in one prefill (bf16 model): the cache's rounding to e4m3 is the
    only difference. Measured 14.266 -> 14.642 (+2.6 %). Scales do not rescue the 3-bit
    mantissa: set per layer from the text's own maxima (max -> 448, 112, 28 or 7), the
    same run gave +1.8 %, +2.7 %, +2.3 %, +1.6 %."""
    tok, ids, model_dtype = opticks
    fp8 = perplexity(tok, ids, cache=CacheConfig(num_blocks=512, cache_dtype="fp8"))
    assert 0 < fp8 / model_dtype - 1 <= 0.03, (fp8, model_dtype)


def test_the_checkpoints_kv_scales_are_read(tmp_path):
    """vLLM's names for an fp8 checkpoint's cache scales, `self_attn.k_scale` / `v_scale`."""
    from hf_models import save_tiny_model
    from safetensors.torch import save_file

    from sluice.engine.attention.torch_backend import TorchAttentionBackend
    from sluice.engine.loader import load_model

    folder = save_tiny_model("llama", tmp_path / "m")
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(0.25),
               "model.layers.1.self_attn.v_scale": torch.tensor(0.5)},
              str(folder / "zz-kv-scales.safetensors"))
    model = load_model(str(folder), "auto", TorchAttentionBackend(), torch.float32,
                       torch.device("cpu"), 0)
    scales = [(layer.self_attn.attn.kv_scale.k, layer.self_attn.attn.kv_scale.v)
              for layer in model.model.layers]
    assert scales[1] == (0.25, 0.5) and set(scales[:1] + scales[2:]) == {(1.0, 1.0)}
    save_file({"model.layers.0.self_attn.q_scale": torch.tensor(1.0)},
              str(folder / "zz-kv-scales.safetensors"))
    with pytest.raises(ValueError, match="unexpected attention parameter 'q_scale'"):
        load_model(str(folder), "auto", TorchAttentionBackend(), torch.float32,
                   torch.device("cpu"), 0)


def _start(model: Path, cache_dtype: str) -> EngineProcess:
    kv = {"kv_connector": "SluiceConnector", "kv_role": "kv_both", "kv_port": 0,
          "kv_connector_extra_config": {"hold_timeout_s": 3, "pull_timeout_s": 5}}
    return EngineProcess("--model", str(model), "--served-model-name", "tiny",
                         "--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "16",
                         "--max-num-batched-tokens", "64", "--kv-cache-dtype", cache_dtype,
                         "--kv-transfer-config", json.dumps(kv))


def _complete(engine: EngineProcess, prompt: str, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, **kw}
    r = httpx.post(engine.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_disaggregated_fp8_equals_plain_and_a_mismatched_cache_is_refused(tiny_chat_model):
    engines = [_start(tiny_chat_model, d) for d in ("fp8", "fp8", "auto")]
    try:
        prefill, decode, other = (e.wait_ready() for e in engines)
        prompt = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(30))
        leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
        for target, pulled in ((decode, True), (other, False)):
            params = _complete(prefill, prompt, max_tokens=1,
                               kv_transfer_params=leg)["kv_transfer_params"]
            got = _complete(target, prompt, kv_transfer_params=params)["choices"][0]["text"]
            plain = _complete(target, prompt, cache_salt=uuid.uuid4().hex)["choices"][0]["text"]
            assert got == plain
            fallbacks = target.metric("sluice:kv_transfer_fallbacks_total")
            assert fallbacks == (0 if pulled else 1)
        log = other.log_path.read_text()
        assert "prefills locally" in log and "float8_e4m3fn" in log and "float32" in log, log
    finally:
        for e in engines:
            e.stop()
