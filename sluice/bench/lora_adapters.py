"""Random LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors),
seeded, for the LoRA benchmark: every projection of every layer at one rank, written as
PEFT names them, so vLLM and Sluice load the same files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sluice.engine.config import ModelConfig
from sluice.engine.lora.peft_adapter import TARGETS, module_shapes


def write_random_adapters(cfg: ModelConfig, folder: Path, count: int, rank: int,
                          seed: int) -> dict[str, Path]:
    """`count` adapters named lora-0 ... under `folder`; name -> its folder."""
    shapes = module_shapes(cfg)
    out = {}
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for module in TARGETS:
                fan_in, fan_out = shapes[module]
                section = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{section}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
        path = folder / f"lora-{i}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
            "base_model_name_or_path": None}))
        from safetensors.torch import save_file

        save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
                  str(path / "adapter_model.safetensors"))
        out[f"lora-{i}"] = path
    return out
