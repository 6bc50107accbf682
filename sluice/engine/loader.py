"""Build a CausalLM from a Hugging Face folder, a GGUF file, or random weights.

Weights arrive under transformers' names; q/k/v and gate/up projections are
concatenated into the fused parameters the decoder uses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from sluice.engine.attention.backend import AttentionBackend
from sluice.engine.config import ModelConfig
from sluice.engine.layers.linear import Linear
from sluice.engine.lora.layers import LoRAContext
from sluice.engine.models.causal_lm import CausalLM
from sluice.engine.models.registry import model_class
from sluice.engine.shapes import SHAPES

_FUSED = {  # fused parameter -> its parts, in order
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def read_hf_config(model: str, load_format: str) -> dict:
    """The transformers-style config dict for a folder, a .gguf, or a named dummy shape."""
    if load_format == "dummy":
        if model in SHAPES:
            return dict(SHAPES[model])
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(
                f"dummy model {model!r} is neither a config file nor one of: {', '.join(SHAPES)}")
        return json.loads(path.read_text())
    if model.endswith(".gguf"):
        from sluice.engine.gguf_loader import load_gguf
        return load_gguf(model)[0]
    return json.loads((Path(model) / "config.json").read_text())


def load_model(model: str, load_format: str, backend: AttentionBackend, dtype: torch.dtype,
               device: torch.device, seed: int = 0,
               weights: Iterator[tuple[str, torch.Tensor]] | None = None,
               lora: LoRAContext | None = None) -> CausalLM:
    """Build the model (with LoRA layers given a context); `weights` (transformers names)
    overrides the checkpoint or dummy init."""
    hf_config = read_hf_config(model, load_format)
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device(device):
        lm = model_class(cfg.architecture)(cfg, backend, lora=lora)
    # Parameters take the engine dtype; rotary frequencies stay float32.
    for p in lm.parameters():
        p.data = p.data.to(dtype)
    if weights is not None:
        _load_weights(lm, weights)
    elif load_format == "dummy":
        _init_random(lm, seed)
    elif model.endswith(".gguf"):
        from sluice.engine.gguf_loader import load_gguf
        _load_weights(lm, load_gguf(model)[1])
    else:
        _load_weights(lm, _iter_safetensors(model))
    # An inference engine: no parameter takes part in autograd, whatever mode a caller
    # runs the model in (an input that requires grad sends the packed linears' oneDNN op
    # through autograd's fallback: ~700x slower).
    lm.requires_grad_(False)
    for module in lm.modules():  # (after loading: a kernel may reorder the weights)
        if isinstance(module, Linear):
            module.process_weights_after_loading()
    return lm.eval()


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield key, f.get_tensor(key)


def _load_weights(lm: CausalLM, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(lm.named_parameters(remove_duplicate=False))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and lm.config.tie_word_embeddings:
            continue
        fused = _fused_target(name)
        if fused is None:
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {lm.config.model_type}")
            _copy(params[name], tensor, name)
            loaded.add(name)
            continue
        target, part = fused
        parts = pending.setdefault(target, {})
        parts[part] = tensor
        group = _FUSED[target.rsplit(".", 2)[-2]]
        if len(parts) == len(group):
            _copy(params[target], torch.cat([parts[p] for p in group], dim=0), target)
            loaded.add(target)
            del pending[target]
    if lm.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing or pending:
        raise ValueError(f"checkpoint is missing weights: {missing or sorted(pending)}")


def _fused_target(name: str) -> tuple[str, str] | None:
    """'model.layers.0.self_attn.k_proj.bias' -> ('model.layers.0.self_attn.qkv_proj.bias', 'k_proj')."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    for fused, group in _FUSED.items():
        if parts[-2] in group:
            return ".".join(parts[:-2] + [fused, parts[-1]]), parts[-2]
    return None


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def _init_random(lm: CausalLM, seed: int) -> None:
    """Small random weights (std 0.02, norms 1), reproducible from the seed."""
    gen = None
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if gen is None:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
