"""Random PEFT LoRA adapters (seeded) saved as real adapter folders, with the greedy output
transformers + PEFT computes with each: the reference the engine's adapters must equal."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(load_base, folder: Path, seed: int, rank: int = 8, alpha: float = 16,
                 targets=ALL_TARGETS, std: float = 0.05, **lora_kwargs):
    """Wrap a fresh base model (`load_base()`) with a LoRA adapter of random A and B,
    save it to `folder`; return the PEFT model (for reference outputs)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **lora_kwargs)
    model = get_peft_model(load_base(), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(folder)
    return model.eval()


def peft_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """Put an adapter folder into a Hugging Face Hub cache at `cache` as `repo_id`'s main
    revision (the layout huggingface_hub reads offline)."""
    import shutil

    sha = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    shutil.copytree(folder, repo / "snapshots" / sha)
    return cache
