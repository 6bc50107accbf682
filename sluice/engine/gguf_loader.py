"""Load a llama.cpp GGUF checkpoint as a Hugging Face style config + float32 tensors.

Contract of `load_gguf(path)`:
* the config dict uses transformers' field names (model_type "llama" | "qwen2" |
  "qwen3", hidden_size, ..., rope_theta, tie_word_embeddings, bos/eos ids, and
  rope_scaling = {"rope_type", "factor", "original_max_position_embeddings"}
  when the file states `<arch>.rope.scaling.type`; llama.cpp's precomputed
  `rope_freqs` tensor (Llama 3.1 style scaling) is skipped, as transformers does);
* the iterator yields every tensor once, under its transformers name
  (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ...,
  lm_head.weight only when the file has its own output matrix), as a `GGUFSlice`:
  indexed like a safetensors slice, it dequantizes what is asked for (only those rows,
  for a slice of rows) to contiguous float32 CPU tensors with the shape transformers
  uses;
* for llama-architecture files, llama.cpp's interleaving of the Q and K rows
  (done for its rotary embedding) is undone, as transformers' GGUF loader does.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from sluice.gguf_tokenizer import gguf_field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors llama.cpp precomputes that have no transformers parameter.
_SKIPPED = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor; None for llama.cpp-only tensors.
    Raises ValueError for a tensor this loader does not know."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, leaf, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[leaf]}.{kind}"


def _rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _embedding_rows(reader: Any) -> int:
    """Rows of token_embd (GGUF lists dimensions innermost first)."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ValueError("GGUF file has no token_embd.weight tensor")


def gguf_config(reader: Any) -> dict[str, Any]:
    """transformers-style config dict from a `gguf.GGUFReader`'s metadata."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks required metadata {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    assert isinstance(kv_heads, int), "per-layer KV head counts are not supported"
    default_head_dim = hidden // heads
    if arch == "llama":  # llama.cpp writes the rotary width, which is the head size for llama
        default_head_dim = key("rope.dimension_count", default_head_dim)
    head_dim = int(key("attention.key_length", default_head_dim))
    tensor_names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [_HF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(gguf_field(reader, f"{arch}.vocab_size", _embedding_rows(reader))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id"),
    }
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    assert config["vocab_size"] > 0, "GGUF file states no vocabulary size"
    return config


def _unpermute_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of Q/K rows (per head: [x0, x2, ..., x1, x3, ...])."""
    rows = weights.shape[0]
    assert rows % (2 * n_head) == 0, f"{rows} rows do not split into {n_head} heads of pairs"
    w = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def _dequantize(tensor: Any, rows: slice = slice(None)) -> np.ndarray:
    """Rows `rows` of a GGUF tensor as float32, shaped like the transformers parameter.
    Quantized blocks run along a row, so a slice of rows is dequantized alone."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data.reshape(shape[0], -1) if len(shape) > 1 else tensor.data
    data = data[rows]
    if tensor.tensor_type == GGMLQuantizationType.F32:
        array = np.asarray(data, dtype=np.float32)
    elif tensor.tensor_type == GGMLQuantizationType.F16:
        array = np.asarray(data).astype(np.float32)
    else:
        array = dequantize(data, tensor.tensor_type)
    array = array.reshape(-1, *shape[1:]) if len(shape) > 1 else array
    assert array.dtype == np.float32
    return array


class GGUFSlice:
    """A tensor of the file, dequantized when indexed (a loader's shard: only its rows are
    dequantized when it asks for rows), with llama.cpp's Q/K row order undone."""

    def __init__(self, tensor: Any, unpermute_heads: int | None):
        self.tensor, self.heads = tensor, unpermute_heads
        self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        self.qtype = int(tensor.tensor_type)  # GGMLQuantizationType

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def raw(self) -> torch.Tensor:
        """The tensor's blocks as stored, uint8 [rows, bytes per row] (rows in transformers'
        order), in memory of its own."""
        data = np.asarray(self.tensor.data).reshape(self.shape[0], -1)
        if self.heads is not None:
            data = _unpermute_rows(data, self.heads)
        return torch.from_numpy(np.array(data, dtype=np.uint8, order="C", copy=True))

    def __getitem__(self, key) -> torch.Tensor:
        rows, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            return self._tensor(self._rows(slice(None)))[key]
        start, stop, _ = rows.indices(self.shape[0])
        return self._tensor(self._rows(slice(start, stop)))[(slice(None), *rest)]

    def _rows(self, rows: slice) -> np.ndarray:
        if self.heads is None:
            return _dequantize(self.tensor, rows)
        head_rows = self.shape[0] // self.heads
        if rows.start % head_rows or rows.stop % head_rows:  # (not whole heads: all rows)
            return _unpermute_rows(_dequantize(self.tensor), self.heads)[rows]
        return _unpermute_rows(_dequantize(self.tensor, rows),
                               (rows.stop - rows.start) // head_rows)

    @staticmethod
    def _tensor(array: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:  # a view into the read-only file mapping
            array = array.copy()
        return torch.from_numpy(array)


def iter_gguf_tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, GGUFSlice]]:
    """Yield (transformers name, lazily dequantized tensor) for every tensor of `reader`."""
    arch = config["model_type"]
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        heads = None
        if arch == "llama" and ".attn_q." in tensor.name:
            heads = config["num_attention_heads"]
        elif arch == "llama" and ".attn_k." in tensor.name:
            heads = config["num_key_value_heads"]
        yield name, GGUFSlice(tensor, heads)


@functools.lru_cache(maxsize=1)
def _open_reader(path: str, mtime_ns: int, size: int) -> Any:
    """One parsed, read-only mapping of the file, reused while it is unchanged
    (the engine reads the config, then the weights: parsing costs ~2 s)."""
    from gguf import GGUFReader

    return GGUFReader(path, "r")


def load_gguf(path: str) -> tuple[dict[str, Any], Iterator[tuple[str, GGUFSlice]]]:
    """Config dict and a lazy iterator of the file's tensors (GGUFSlice)."""
    stat = os.stat(path)
    reader = _open_reader(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    config = gguf_config(reader)
    return config, iter_gguf_tensors(reader, config)
