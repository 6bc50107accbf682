"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

Family differences are flags on ModelConfig: `attention_bias` (Qwen2's q/k/v
bias), `qk_norm` (Qwen3's per-head RMSNorm on q and k before RoPE),
`rope_scaling` (llama3), `tie_word_embeddings`. Parameter names follow
transformers', except that q/k/v and gate/up are fused (`qkv_proj`,
`gate_up_proj`); the loader concatenates them.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.attention.backend import AttentionBackend, AttentionMetadata
from sluice.engine.config import ModelConfig
from sluice.engine.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from sluice.engine.model.linear import Linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def forward(self, cos_sin, x, kv_cache: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(cos_sin, q, k)
        self.backend.write_kv(k, v, kv_cache, meta)
        o = self.backend.attend(q, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, cos_sin, x, kv_cache, meta):
        x = x + self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling))


class CausalLM(nn.Module):
    """forward: flat tokens of one step -> final hidden states; compute_logits on chosen rows."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg, backend)
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
