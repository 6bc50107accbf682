"""The decoder-only language model every family in `models/` is: token embeddings, a stack
of the family's decoder layers, a final RMSNorm, and an LM head (tied to the embeddings
where the config says so). Parameter names follow transformers', except that q/k/v and
gate/up are fused (`qkv_proj`, `gate_up_proj`); the loader concatenates them. Built with a
`LoRAContext`, the projections a PEFT adapter may target are LoRA layers (lora/layers.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from sluice.engine.attention.backend import AttentionBackend, AttentionMetadata
from sluice.engine.config import ModelConfig
from sluice.engine.layers.layernorm import RMSNorm
from sluice.engine.layers.linear import Linear
from sluice.engine.layers.rotary_embedding import RotaryEmbedding
from sluice.engine.lora.layers import LoRAContext


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 layer_cls: type[nn.Module], lora: LoRAContext | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, backend, lora)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling))


class CausalLM(nn.Module):
    """forward: flat tokens of one step -> final hidden states; compute_logits on chosen rows.

    A family sets `layer_cls`, its decoder layer: `layer_cls(cfg, backend, lora)`, called as
    `layer(cos_sin, x, kv_cache, meta) -> x`."""

    layer_cls: ClassVar[type[nn.Module]]

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 lora: LoRAContext | None = None):
        super().__init__()
        self.config = cfg
        self.attn_backend = backend
        self.lora = lora
        self.model = DecoderModel(cfg, backend, self.layer_cls, lora)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary.cos_sin(positions, x.dtype)  # one per step, every layer's
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(cos_sin, x, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
