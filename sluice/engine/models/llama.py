"""Llama (and Mistral, the same shape; sliding windows are refused by the config): pre-norm
decoder layers of grouped-query attention with rotary embeddings and a SwiGLU MLP.
`attention_bias` in the config puts a bias on q/k/v.

Under tensor parallelism (`tp`) each rank holds whole heads: q/k/v and gate/up are
column-parallel, o and down row-parallel, one all-reduce each (layers/parallel_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.attention.backend import AttentionBackend, AttentionMetadata
from sluice.engine.config import ModelConfig
from sluice.engine.distributed.parallel_state import SINGLE, TPGroup
from sluice.engine.layers.activation import SiluAndMul
from sluice.engine.layers.attention import Attention
from sluice.engine.layers.layernorm import RMSNorm
from sluice.engine.layers.parallel_linear import column_shards, kv_heads_per_rank, qkv_shards
from sluice.engine.layers.quantization import QuantMethod
from sluice.engine.layers.rotary_embedding import RotaryEmbedding
from sluice.engine.lora.layers import LoRAContext, column_linear, row_linear
from sluice.engine.models.causal_lm import CausalLM


class LlamaAttention(nn.Module):
    qkv_bias: bool | None = None  # a family's fixed choice; None: the config's attention_bias

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 lora: LoRAContext | None = None, tp: TPGroup = SINGLE,
                 quant: QuantMethod | None = None):
        super().__init__()
        n, head_dim = tp.world_size, cfg.head_dim
        shards = qkv_shards(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, tp)
        self.num_heads = cfg.num_attention_heads // n  # this rank's
        self.num_kv_heads = kv_heads_per_rank(cfg.num_key_value_heads, n)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        bias = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        self.qkv_proj = column_linear(cfg.hidden_size, shards, bias, lora, tp, quant)
        self.o_proj = row_linear(cfg.num_attention_heads * head_dim, "o_proj", cfg.hidden_size,
                                 False, lora, tp, quant)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def weight_loader(self, param: str, full, part: str) -> None:
        """The checkpoint's `self_attn.k_scale` / `v_scale` (this module's only own tensors)."""
        self.attn.load_kv_scale(param, float(full[...]))  # a scalar, or one element

    def forward(self, cos_sin, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(cos_sin, *self.normalize_qk(q, k))
        o = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(o.reshape(-1, self.q_size))

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k before rotary (Llama: as they are)."""
        return q, k


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig, lora: LoRAContext | None = None,
                 tp: TPGroup = SINGLE, quant: QuantMethod | None = None):
        super().__init__()
        f = cfg.intermediate_size
        self.gate_up_proj = column_linear(
            cfg.hidden_size, column_shards({"gate_proj": f, "up_proj": f}, tp), False, lora, tp,
            quant)
        self.act_fn = SiluAndMul()
        self.down_proj = row_linear(f, "down_proj", cfg.hidden_size, False, lora, tp, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 lora: LoRAContext | None = None, tp: TPGroup = SINGLE,
                 quant: QuantMethod | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, backend, lora, tp, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, lora, tp, quant)

    def forward(self, cos_sin, x, kv_cache, meta):
        x = x + self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
