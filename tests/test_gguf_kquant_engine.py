"""`--quantization gguf` on a tiny random Llama whose matrices are all K-quants (Q4_K_M's
mix: Q4_K, Q5_K and Q6_K projections, a Q4_K embedding, a Q6_K LM head or the embedding's
blocks tied): the engine keeps every matrix as the file's blocks and, teacher-forced on the
dequantized float32 path's own greedy text, picks its next token at >= 95 % of positions
through the integer dot products (steps of 4 tokens) and at all of them through tiles
(exact dequantized weights). The weights are random blocks (tests/gguf_blocks.py), centred
and scaled as a trained layer's (std 1/sqrt(in) in the projections; 0.25 in the embedding and
the LM head, for logits of std ~4: a tied embedding of std 1 echoes the input token), so the
greedy text varies (checked) and a kernel that misread a block would change it."""

from __future__ import annotations

import numpy as np
import pytest
from perplexity import teacher_forced

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize
from gguf_blocks import Q, k_quant_blocks

from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.layers.gguf_linear import GGUFEmbedding, GGUFLinear
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 512, 2
LAYER_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
               "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K}
PROMPTS, NEW_TOKENS = 6, 32


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype, std: float) -> np.ndarray:
    """Random blocks whose values have about this std (d scaled from a first draw's)."""
    first = dequantize(k_quant_blocks(rng, rows, cols, qtype, d=(0.5, 1.5), centred=True), qtype)
    unit = float(first.std())
    return k_quant_blocks(rng, rows, cols, qtype, d=(0.5 * std / unit, 1.5 * std / unit),
                          centred=True)


def _write_model(path: str, tied: bool) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    matrices = {"token_embd.weight": (VOCAB, HIDDEN, Q.Q4_K, 0.25)}
    if not tied:
        matrices["output.weight"] = (VOCAB, HIDDEN, Q.Q6_K, 0.25)
    for i in range(LAYERS):
        for name, qtype in LAYER_TYPES.items():
            rows, cols = {"attn_q": (HEADS * HEAD_DIM, HIDDEN),
                          "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
                          "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
                          "attn_output": (HIDDEN, HEADS * HEAD_DIM),
                          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
                          "ffn_down": (HIDDEN, FFN)}[name]
            matrices[f"blk.{i}.{name}.weight"] = (rows, cols, qtype, cols ** -0.5)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for name, (rows, cols, qtype, std) in matrices.items():
        writer.add_tensor(name, _blocks(rng, rows, cols, qtype, std), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[False, True], ids=["own LM head", "tied"])
def model_path(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf")
    _write_model(path, tied=request.param)
    return path


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, served_model_name="m", dtype="float32",
                                  cache=CacheConfig(num_blocks=64), **kw))


@pytest.mark.parametrize("step_tokens", [4, 2048], ids=["integer dot products", "tiles"])
def test_quantized_picks_the_float32_paths_tokens(model_path, step_tokens):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=int(rng.integers(5, 20))).tolist()
               for _ in range(PROMPTS)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    texts = _engine(model_path).generate(prompts, greedy)
    assert len({t for text in texts for t in text}) >= 20, "a text that varies"
    quantized = _engine(model_path, quantization="gguf",
                        scheduler=SchedulerConfig(max_num_batched_tokens=step_tokens))
    kept = {qtype for m in quantized.model.modules() if isinstance(m, GGUFLinear)
            for qtype, _ in m.runs}
    kept |= {m.data[0] for m in quantized.model.modules() if isinstance(m, GGUFEmbedding)}
    assert kept == {int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)}, "every matrix kept as blocks"
    agree, total, first_divergence = teacher_forced(quantized, prompts, texts)
    assert total == PROMPTS * NEW_TOKENS
    print(f"agreement {agree}/{total}; first divergence per prompt {first_divergence}")
    assert agree / total >= (0.95 if step_tokens == 4 else 1.0), (agree, total,
                                                                  first_divergence)
