"""Qwen2: Llama's layers with a bias on q/k/v, always (its config has no attention_bias).
Sliding windows are refused by the config."""

from __future__ import annotations

from sluice.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
