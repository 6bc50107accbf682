"""Qwen3: Llama's layers with an RMSNorm over each head of q and k before rotary
(`q_norm`, `k_norm`); q/k/v take a bias only where the config's attention_bias says."""

from __future__ import annotations

import torch

from sluice.engine.attention.backend import AttentionBackend
from sluice.engine.config import ModelConfig
from sluice.engine.distributed.parallel_state import SINGLE, TPGroup
from sluice.engine.layers.layernorm import RMSNorm
from sluice.engine.layers.quantization import QuantMethod
from sluice.engine.lora.layers import LoRAContext
from sluice.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 lora: LoRAContext | None = None, tp: TPGroup = SINGLE,
                 quant: QuantMethod | None = None):
        super().__init__(cfg, backend, lora, tp, quant)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
