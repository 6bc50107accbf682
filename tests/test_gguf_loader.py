"""sluice.engine.gguf_loader against transformers' GGUF loading: the bundled
SmolLM2 Q4_1/Q8_0 file, and small synthetic llama / qwen2 / qwen3 files."""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from sluice.default_model import resolve_default_model
from sluice.engine.gguf_loader import hf_tensor_name, load_gguf

CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def _reference(path: str, fast: bool = False) -> tuple[object, dict[str, torch.Tensor]]:
    """transformers' config and float32 state dict for a GGUF file.

    By default `from_pretrained(gguf_file=...)`, or, without `accelerate`, the
    function it calls for llama / qwen2 / qwen3 files (`load_gguf_checkpoint`
    with the model to load). `fast` calls that function only once, on a meta
    model shaped by the file's own layer count: it parses the file's 100k
    tokenizer strings once instead of three times (SmolLM2: ~10 s, not ~25 s).
    """
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.dirname(path), os.path.basename(path)
    if not fast and importlib.util.find_spec("accelerate") is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
        return model.config, model.state_dict()
    if fast:
        metadata, _ = read_gguf_metadata(path)
        arch = metadata["general.architecture"]
        config = transformers.AutoConfig.for_model(
            arch, num_hidden_layers=metadata[f"{arch}.block_count"]
        )
    else:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    fields = dict(parsed["config"])
    ref_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    tensors = parsed["tensors"]
    if ref_config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return ref_config, tensors


def _assert_matches_transformers(
    path: str, expected_type: str, fast: bool = False
) -> tuple[dict, dict[str, torch.Tensor], float]:
    """Load `path` with sluice and with transformers, assert they agree;
    return our config, tensors and load time."""
    start = time.perf_counter()
    config, iterator = load_gguf(path)
    ours = {name: t[:] for name, t in iterator}
    seconds = time.perf_counter() - start
    ref_config, ref_tensors = _reference(path, fast)
    assert config["model_type"] == ref_config.model_type == expected_type
    for field in CONFIG_FIELDS:
        assert config[field] == getattr(ref_config, field), field
    # Qwen2Config has no head_dim attribute: it is hidden_size // num_attention_heads there
    ref_head_dim = (
        getattr(ref_config, "head_dim", None)
        or ref_config.hidden_size // ref_config.num_attention_heads
    )
    assert config["head_dim"] == ref_head_dim
    assert config["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    expected_names = set(ref_tensors) - (
        {"lm_head.weight"} if config["tie_word_embeddings"] else set()
    )
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.equal(tensor, ref_tensors[name].float()), name
    return config, ours, seconds


@pytest.mark.slow  # the default model through transformers
def test_bundled_smollm2_matches_transformers() -> None:
    config, ours, seconds = _assert_matches_transformers(
        resolve_default_model(), "llama", fast=True
    )
    assert seconds < 30  # ~3.5 s on one free core
    assert len(ours) == 272 and config["tie_word_embeddings"] and config["head_dim"] == 64
    assert config["rope_theta"] == 100000.0 and "rope_scaling" not in config


Q = gguf.GGMLQuantizationType
# Cycled over the 2-D tensors; one whose row length is not a whole number of blocks stays F32.
MATRIX_TYPES = [Q.F16, Q.Q8_0, Q.Q4_1, Q.Q6_K, Q.Q4_0, Q.BF16, Q.Q5_1, Q.Q4_K]


def _k_quant_blocks(rng: np.random.Generator, shape: tuple[int, int], kind: Q) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize these) with sane f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    scales = (
        np.full(raw.shape[:2], 0.01, dtype=np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    )
    if kind == Q.Q6_K:  # ... scales[16] int8, d f16 (last)
        raw[..., -2:] = scales
    else:  # Q4_K: d f16, dmin f16, scales[12], qs[128]
        raw[..., 0:2] = scales
        raw[..., 2:4] = scales
    return raw.reshape(shape[0], -1)


def _write_gguf(
    path: str,
    arch: str,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    ffn: int = 512,
    vocab: int = 80,
    tied: bool = False,
    bias: bool = False,
    qk_norm: bool = False,
    linear_rope: float | None = None,
    vocab_in_metadata: bool = True,
) -> dict[str, np.ndarray]:
    """A small random checkpoint in llama.cpp's layout with mixed tensor types;
    returns each tensor as written (before quantization), in GGUF naming."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if vocab_in_metadata:
        writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if linear_rope is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_rope)
        writer.add_rope_scaling_orig_ctx_len(128)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        block = {
            "attn_norm.weight": (hidden,),
            "ffn_norm.weight": (hidden,),
            "attn_q.weight": (heads * head_dim, hidden),
            "attn_k.weight": (kv_heads * head_dim, hidden),
            "attn_v.weight": (kv_heads * head_dim, hidden),
            "attn_output.weight": (hidden, heads * head_dim),
            "ffn_gate.weight": (ffn, hidden),
            "ffn_up.weight": (ffn, hidden),
            "ffn_down.weight": (hidden, ffn),
        }
        if bias:
            block |= {
                "attn_q.bias": (heads * head_dim,),
                "attn_k.bias": (kv_heads * head_dim,),
                "attn_v.bias": (kv_heads * head_dim,),
            }
        if qk_norm:
            block |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
        shapes |= {f"blk.{i}.{k}": v for k, v in block.items()}
    written, matrices = {}, 0
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        kind = Q.F32
        if len(shape) == 2:
            kind, matrices = MATRIX_TYPES[matrices % len(MATRIX_TYPES)], matrices + 1
            if shape[1] % gguf.GGML_QUANT_SIZES[kind][0]:
                kind = Q.F32
        if kind == Q.F32:
            writer.add_tensor(name, data)
        elif kind == Q.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif kind in (Q.Q6_K, Q.Q4_K):
            raw = _k_quant_blocks(rng, shape, kind)
            writer.add_tensor(name, raw, raw_dtype=kind)
            data = gguf.quants.dequantize(raw, kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        written[name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.mark.parametrize(
    "arch,options",
    [
        ("llama", {"kv_heads": 2}),
        ("llama", {"kv_heads": 4, "tied": True}),
        ("qwen2", {"bias": True, "linear_rope": 4.0}),
        ("qwen3", {"qk_norm": True, "head_dim": 128, "heads": 2, "kv_heads": 1}),
    ],
)
@pytest.mark.slow  # transformers' GGUF loading, per architecture
def test_synthetic_checkpoints_match_transformers(tmp_path, arch: str, options: dict) -> None:
    path = str(tmp_path / f"{arch}.gguf")
    written = _write_gguf(path, arch, **options)
    config, ours, _ = _assert_matches_transformers(path, arch)
    assert len(ours) == len(written)
    assert config["attention_bias"] == options.get("bias", False)
    if "linear_rope" in options:  # transformers' GGUF loader drops rope scaling; llama.cpp's keys
        assert config["rope_scaling"] == {
            "rope_type": "linear",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    else:
        assert "rope_scaling" not in config
    # The Q/K row order differs from the file only for llama (llama.cpp's rope permutation).
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    raw_q = torch.from_numpy(written["blk.0.attn_q.weight"])
    # (mean |error| of 4-bit quantization is ~0.1; of two unrelated N(0,1) values ~1.1)
    assert ((q - raw_q).abs().mean() < 0.3) == (arch != "llama")
    v = ours["model.layers.0.self_attn.v_proj.weight"]
    assert (v - torch.from_numpy(written["blk.0.attn_v.weight"])).abs().mean() < 0.3


def test_vocab_size_defaults_to_embedding_rows(tmp_path) -> None:
    path = str(tmp_path / "novocab.gguf")
    _write_gguf(path, "qwen3", layers=1, vocab=96, qk_norm=True, vocab_in_metadata=False)
    config, tensors = load_gguf(path)
    assert (
        config["vocab_size"]
        == 96
        == next(t for n, t in tensors if n == "model.embed_tokens.weight").shape[0]
    )


def test_unknown_tensors_and_architectures_are_errors(tmp_path) -> None:
    assert hf_tensor_name("rope_freqs.weight") is None
    assert hf_tensor_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)


def test_a_slice_of_rows_is_dequantized_alone_and_equals_the_whole_tensors_rows() -> None:
    """What a tensor-parallel rank reads: its heads of q (whole heads: the un-permuting
    works on them alone), rows of k that split a head, embedding rows, down's columns."""
    _, tensors = load_gguf(resolve_default_model())
    wanted = {"model.layers.0.self_attn.q_proj.weight": (slice(192, 384),),
              "model.layers.0.self_attn.k_proj.weight": (slice(32, 96),),
              "model.embed_tokens.weight": (slice(16384, 32768),),
              "model.layers.0.mlp.down_proj.weight": (slice(None), slice(512, 1024))}
    seen = 0
    for name, t in tensors:
        if name in wanted:
            whole = t[:]
            assert tuple(whole.shape) == t.get_shape()
            assert torch.equal(t[wanted[name]], whole[wanted[name]]), name
            seen += 1
    assert seen == len(wanted)
