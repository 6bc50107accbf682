"""Tiny random-weight Hugging Face models saved as real folders (config + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def tiny_config(family: str) -> dict:
    base = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "initializer_range": 0.2, "bos_token_id": 1,
            "eos_token_id": 2}
    if family == "llama":
        return dict(base, model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "qwen2":
        return dict(base, model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1e6,
                    tie_word_embeddings=True)
    if family == "qwen3":
        return dict(base, model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1e6, head_dim=32,
                    num_key_value_heads=1, tie_word_embeddings=True)
    raise ValueError(family)


def save_tiny_model(family: str, folder: Path, seed: int = 0) -> Path:
    """Create the model with transformers, randomise it, save it; return the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = tiny_config(family)
    config = AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their trivial init
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    assert json.loads((folder / "config.json").read_text())["model_type"] == family
    return folder


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def save_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama with the default model's real tokenizer and chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sluice.default_model import resolve_default_model

    gguf = Path(resolve_default_model())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = dict(tiny_config("llama"), vocab_size=len(tok), bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
