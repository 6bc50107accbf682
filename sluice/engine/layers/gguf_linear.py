"""Layers over GGUF's quantized blocks as the file stores them (`--quantization gguf`):
the weights stay the file's bytes, a third of bf16's for 4-bit types. Types with a kernel:
Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K (KERNEL_TYPES). A call of a few rows
(a decode) multiplies the blocks as they are (csrc/gguf.c, gguf_k.c: activations rounded to
8 bits per block of 32, integer dot products, llama.cpp's scheme); more rows go through a
tile of dequantized weights made for the call (gguf_bindings.cpp). Tensors of other types
(F32, F16, BF16, Q5_0, Q2_K, ...) are dequantized at load into the engine dtype and
multiplied by torch.

- `GGUFLinear`: a projection whose output is its parts (transformers' names) concatenated;
  consecutive parts of one type share one kernel call.
- `GGUFEmbedding`: rows dequantized as they are looked up.
- `GGUFLMHead`: the LM head, or, tied, the embedding's blocks read as a linear.
One rank only (the config refuses tensor parallelism with them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.layers.parallel_linear import check_shape

# GGMLQuantizationType: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K (csrc/gguf.h)
KERNEL_TYPES = frozenset({2, 3, 8, 12, 13, 14})
_FLOAT = -1  # a part held dequantized


@dataclass(frozen=True)
class GGUFQuant:
    """Chosen by `--quantization gguf` (a QuantMethod, layers/quantization.py): the engine
    dtype of activations and of the tensors dequantized at load."""

    dtype: torch.dtype

    def linear(self, in_features: int, parts: dict[str, int], bias: bool) -> GGUFLinear:
        return GGUFLinear(in_features, parts, bias, self)

    def embedding(self, vocab_size: int, hidden_size: int) -> GGUFEmbedding:
        return GGUFEmbedding(vocab_size, hidden_size, self)

    def lm_head(self, embedding: GGUFEmbedding, tied: bool) -> GGUFLMHead:
        return GGUFLMHead(embedding, tied)


def _loaded(full, rows: int, cols: int, what: str, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """(type, blocks) of a GGUF tensor with a kernel, else (_FLOAT, its values in dtype)."""
    check_shape(full, (rows, cols), what)
    qtype = getattr(full, "qtype", None)
    if qtype in KERNEL_TYPES:
        return qtype, full.raw()
    return _FLOAT, full[:].to(dtype)


class GGUFLinear(nn.Module):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, quant: GGUFQuant):
        super().__init__()
        self.in_features, self.parts, self.quant = in_features, dict(parts), quant
        self.out_features = sum(parts.values())
        self.offsets = dict(zip(parts, itertools.accumulate(parts.values(), initial=0)))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.loaded: dict[str, tuple[int, torch.Tensor]] = {}
        self.runs: list[tuple[int, torch.Tensor]] = []  # (type, blocks or weight), in order

    def weight_loader(self, param: str, full, part: str) -> None:
        if param == "bias":
            off, size = self.offsets[part], self.parts[part]
            check_shape(full, (size,), f"{part}.bias")
            with torch.no_grad():
                self.bias[off:off + size].copy_(full[:])
            return
        self.loaded[part] = _loaded(full, self.parts[part], self.in_features, f"{part}.weight",
                                    self.quant.dtype)

    def process_weights_after_loading(self) -> None:
        """Merge consecutive parts of one type (ValueError naming a missing part)."""
        missing = [p for p in self.parts if p not in self.loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing}")
        runs: list[tuple[int, list[torch.Tensor]]] = []
        for part in self.parts:
            qtype, data = self.loaded.pop(part)
            if runs and runs[-1][0] == qtype:
                runs[-1][1].append(data)
            else:
                runs.append((qtype, [data]))
        self.runs = [(qtype, torch.cat(data) if len(data) > 1 else data[0])
                     for qtype, data in runs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, rows = x.shape[:-1], x.reshape(-1, self.in_features)
        outs = [F.linear(rows, data) if qtype == _FLOAT
                else torch.ops.sluice.gguf_linear(rows, data, qtype).to(x.dtype)
                for qtype, data in self.runs]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


class GGUFEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, quant: GGUFQuant):
        super().__init__()
        self.vocab_size, self.hidden_size, self.quant = vocab_size, hidden_size, quant
        self.data: tuple[int, torch.Tensor] | None = None

    def weight_loader(self, param: str, full, part: str) -> None:
        self.data = _loaded(full, self.vocab_size, self.hidden_size, f"{part}.{param}",
                            self.quant.dtype)

    def process_weights_after_loading(self) -> None:
        if self.data is None:
            raise ValueError("checkpoint is missing weights: ['model.embed_tokens.weight']")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        qtype, data = self.data
        if qtype == _FLOAT:
            return F.embedding(ids, data)
        rows = torch.ops.sluice.gguf_dequantize(data, qtype, ids.reshape(-1))
        return rows.to(self.quant.dtype).view(*ids.shape, self.hidden_size)


class GGUFLMHead(GGUFLinear):
    """Logits over the vocabulary; tied: the embedding's blocks."""

    def __init__(self, embedding: GGUFEmbedding, tied: bool):
        super().__init__(embedding.hidden_size, {"lm_head": embedding.vocab_size}, False,
                         embedding.quant)
        # (a list: the embedding is the model's module, not a submodule of the head)
        self.tied_to = [embedding] if tied else []

    def process_weights_after_loading(self) -> None:
        for embedding in self.tied_to:
            self.loaded["lm_head"] = embedding.data
        super().process_weights_after_loading()
