"""The quantization plug point (vLLM's QuantizationConfig): how a quantized checkpoint's
layers are built, chosen once at start-up and handed to the model's constructors.

- `GGUFQuant` (layers/gguf_linear.py, `--quantization gguf`): a GGUF file's blocks kept,
  for the projections, the embedding and the LM head;
- `FP8Quant` (layers/fp8_linear.py, `--quantization fp8` or a checkpoint declaring it):
  e4m3 projections; embedding and LM head as the checkpoint stores them;
- `Int4Quant` (layers/int4_linear.py, a checkpoint declaring gptq or awq): packed int4
  projections (W4A16); embedding and LM head in float, as those checkpoints store them.
`None` builds the plain (tensor-parallel) layers.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from sluice.engine.distributed.parallel_state import TPGroup


class QuantMethod(Protocol):
    dtype: torch.dtype  # the engine's: activations, and whatever is dequantized

    def linear(self, in_features: int, parts: dict[str, int], bias: bool) -> nn.Module:
        """A projection whose output is `parts` (transformers' names) concatenated; it
        takes checkpoint tensors through `weight_loader(param, full, part)`."""

    def embedding(self, vocab_size: int, hidden_size: int) -> nn.Module | None:
        """The token embedding, or None for the plain one."""

    def lm_head(self, embedding: nn.Module, tied: bool) -> nn.Module | None:
        """The LM head (reading `embedding`'s weights when tied), or None for the plain one."""


def quant_method(name: str | None, hf_config: dict, dtype: torch.dtype,
                 tp: TPGroup) -> QuantMethod | None:
    """The method `--quantization name` asks for, or the checkpoint's config declares."""
    from sluice.engine.layers.fp8_linear import fp8_quant
    from sluice.engine.layers.gguf_linear import GGUFQuant
    from sluice.engine.layers.int4_linear import int4_quant

    if name == "gguf":
        quant = GGUFQuant(dtype)
    else:
        quant = int4_quant(hf_config, name, dtype) or fp8_quant(hf_config, name, dtype)
    if quant is not None and tp.world_size > 1:
        raise ValueError(f"a {type(quant).__name__} model is served on one rank: "
                         "--tensor-parallel-size 1")
    return quant
