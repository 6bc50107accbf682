"""The decoder-only language model every family in `models/` is: token embeddings, a stack
of the family's decoder layers, a final RMSNorm, and an LM head (tied to the embeddings
where the config says so). Parameter names follow transformers', except that q/k/v and
gate/up are fused (`qkv_proj`, `gate_up_proj`); the loader concatenates them. Built with a
`LoRAContext`, the projections a PEFT adapter may target are LoRA layers (lora/layers.py).
Built with a quantization method (layers/quantization.py), its layers replace the plain
ones: a GGUF file's blocks kept, or fp8 projections. Built with a tensor-parallel group of N
ranks, each rank's model holds its shard (a 1/N
slice of the vocabulary, of every layer's heads and of the MLP) and `compute_logits`
returns the whole vocabulary's logits on rank 0, None on the others.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from sluice.engine.attention.backend import AttentionBackend, AttentionMetadata
from sluice.engine.config import ModelConfig
from sluice.engine.distributed.parallel_state import SINGLE, TPGroup
from sluice.engine.layers.layernorm import RMSNorm
from sluice.engine.layers.parallel_linear import kv_heads_per_rank
from sluice.engine.layers.quantization import QuantMethod
from sluice.engine.layers.rotary_embedding import RotaryEmbedding
from sluice.engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sluice.engine.lora.layers import LoRAContext


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 layer_cls: type[nn.Module], lora: LoRAContext | None, tp: TPGroup,
                 quant: QuantMethod | None):
        super().__init__()
        embed = quant.embedding(cfg.vocab_size, cfg.hidden_size) if quant else None
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
                             if embed is None else embed)
        self.layers = nn.ModuleList(layer_cls(cfg, backend, lora, tp, quant)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling))


class CausalLM(nn.Module):
    """forward: flat tokens of one step -> final hidden states; compute_logits on chosen rows.

    A family sets `layer_cls`, its decoder layer: `layer_cls(cfg, backend, lora, tp, quant)`,
    called as `layer(cos_sin, x, kv_cache, meta) -> x`."""

    layer_cls: ClassVar[type[nn.Module]]

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 lora: LoRAContext | None = None, tp: TPGroup = SINGLE,
                 quant: QuantMethod | None = None):
        super().__init__()
        self.config = cfg
        self.attn_backend = backend
        self.lora, self.tp = lora, tp
        self.model = DecoderModel(cfg, backend, self.layer_cls, lora, tp, quant)
        embed, tied = self.model.embed_tokens, cfg.tie_word_embeddings
        head = quant.lm_head(embed, tied) if quant else None
        self.lm_head = ParallelLMHead(embed, tied) if head is None else head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                num_layers: int = 0) -> torch.Tensor:
        """`num_layers`: the first this many layers only, then the final norm (an early-exit
        draft, spec_decode/early_exit.py); 0: every layer."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary.cos_sin(positions, x.dtype)  # one per step, every layer's
        layers = self.model.layers[:num_layers] if num_layers else self.model.layers
        for layer, kv_cache in zip(layers, kv_caches):
            x = layer(cos_sin, x, kv_cache, meta)
        return self.model.norm(x)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's cache holds."""
        return kv_heads_per_rank(self.config.num_key_value_heads, self.tp.world_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()
