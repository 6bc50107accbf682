"""The model registry (sluice/engine/models/registry.py): each family found by its
`architectures` name (or model_type), its layers as transformers builds them, and a clear
error for any other."""

import pytest
import torch

from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.config import ModelConfig
from sluice.engine.models.registry import SUPPORTED_ARCHITECTURES, architecture_of, model_class
from sluice.engine.shapes import SHAPES

TINY = {k: v for k, v in SHAPES["tiny-llama"].items() if k != "model_type"}


def build(**hf):
    cfg = ModelConfig.from_hf({**TINY, **hf})
    return model_class(cfg.architecture)(cfg, TorchAttentionBackend())


@pytest.mark.parametrize(("hf", "family"), [
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "LlamaForCausalLM"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "Qwen3ForCausalLM"),
    ({"model_type": "qwen3"}, "Qwen3ForCausalLM"),  # a named dummy shape: no architectures
    ({}, "LlamaForCausalLM"),
])
def test_each_family_builds_its_class(hf, family):
    assert type(build(**hf)).__name__ == family


def test_the_families_differ_where_transformers_does():
    attn = {arch: build(architectures=[arch]).model.layers[0].self_attn
            for arch in SUPPORTED_ARCHITECTURES}
    assert attn["LlamaForCausalLM"].qkv_proj.bias is None
    assert attn["Qwen2ForCausalLM"].qkv_proj.bias is not None  # always, as in transformers
    assert build(architectures=["LlamaForCausalLM"], attention_bias=True).model.layers[
        0].self_attn.qkv_proj.bias is not None
    names = dict(attn["Qwen3ForCausalLM"].named_parameters())
    assert {"q_norm.weight", "k_norm.weight"} <= set(names)
    assert not any("norm" in n for n, _ in attn["LlamaForCausalLM"].named_parameters())


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        architecture_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**TINY, "model_type": "gpt2"})
    # the first architecture the registry knows wins
    assert architecture_of({"architectures": ["Foo", "Qwen2ForCausalLM"]}) == "Qwen2ForCausalLM"


def test_the_models_tied_head_shares_the_embedding():
    lm = build(tie_word_embeddings=True)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert torch.equal(lm.compute_logits(torch.zeros(1, TINY["hidden_size"])),
                       torch.zeros(1, TINY["vocab_size"]))
