"""Read a PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`)
into per-layer (A, B) pairs for the base model's projections.

The path is a folder or, as vLLM takes it, a Hugging Face Hub repository id (`org/name`),
fetched into the Hub cache (its two files only; HF_TOKEN, HF_HUB_OFFLINE and HF_HUB_CACHE
apply as they do to transformers).

PEFT computes y = W x + B (A x) * scaling with scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with `use_rslora`; `alpha_pattern` overrides lora_alpha per module
and `rank_pattern` r (the tensors carry the rank). The scaling is folded into B here,
once. Everything else an adapter may hold (DoRA, trained biases, embedding or LM-head
adapters, modules_to_save) changes what the model computes beyond a low-rank delta of
q/k/v/o/gate/up/down, and is refused with a message naming it, as is a rank above
--max-lora-rank or a shape that is not the base model's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.engine.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")


class LoRAError(ValueError):
    """An adapter this engine cannot serve; the message says why (a 400 to a client)."""


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's deltas: (layer, module) -> (A [r, in], B·scaling [out, r])."""

    path: str
    rank: int  # the largest of its modules' ranks
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) features in the base model."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def resolve_adapter(path: str) -> Path:
    """The adapter's folder: `path` itself, or a Hub repository's snapshot."""
    folder = Path(path)
    if folder.exists() or not _REPO_ID.fullmatch(path):
        return folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path, allow_patterns=[
            "adapter_config.json", "adapter_model.safetensors"]))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise LoRAError(f"{path}: no such folder, and no Hugging Face Hub adapter by that "
                        f"name could be fetched ({type(exc).__name__}: {exc})") from None


def load_peft_adapter(path: str, cfg: ModelConfig, max_rank: int,
                      dtype: torch.dtype) -> LoRAWeights:
    folder = resolve_adapter(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoRAError(f"no adapter_config.json in {path}")
    if not weights_file.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        raise LoRAError(f"no adapter_model.safetensors in {path}" + (
            " (adapter_model.bin is a pickle, which this engine does not load)" if pickled
            else ""))
    try:
        pcfg = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{config_file}: not readable JSON ({exc})") from None
    if not isinstance(pcfg, dict):
        raise LoRAError(f"{config_file}: not a JSON object")
    _check_config(pcfg)
    tensors = _read_tensors(weights_file)
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoRAError(f"adapter weight {key!r} is not a LoRA A/B matrix of "
                            f"{'/'.join(TARGETS)} (only those are served)")
        layer, module = int(m.group(1)), m.group(2)
        if layer >= cfg.num_hidden_layers:
            raise LoRAError(f"adapter weight {key!r}: the base model has "
                            f"{cfg.num_hidden_layers} layers")
        pairs.setdefault((layer, module), {})[m.group(3)] = tensor
    if not pairs:
        raise LoRAError(f"{weights_file} holds no LoRA weights")
    modules, rank = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise LoRAError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                            f"not fit the base model (expected [r, {fan_in}] and "
                            f"[{fan_out}, r])")
        if not 1 <= r <= max_rank:
            raise LoRAError(f"{where}: rank {r} is over --max-lora-rank {max_rank}")
        section = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        scale = _scaling(pcfg, f"model.layers.{layer}.{section}.{module}", r)
        modules[(layer, module)] = (a.to(dtype).contiguous(),
                                    (b.double() * scale).to(dtype).contiguous())
        rank = max(rank, r)
    return LoRAWeights(path, rank, modules)


def _check_config(pcfg: dict) -> None:
    if pcfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {pcfg.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "lora_bias": "trained LoRA biases", "layer_replication": "layer_replication",
    }
    for key, what in refused.items():
        if pcfg.get(key):
            raise LoRAError(f"{what} are not supported (adapter_config.json {key})")
    if pcfg.get("bias", "none") != "none":
        raise LoRAError(f"bias {pcfg['bias']!r} is not supported: only 'none'")
    alpha = pcfg.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAError(f"lora_alpha must be a positive number, got {alpha!r}")


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"{file}: not a readable safetensors file ({exc})") from None


def _scaling(pcfg: dict, module: str, rank: int) -> float:
    """PEFT's scaling for `module` (alpha_pattern keys are regexes matched at the end of
    the module's name, as PEFT matches them)."""
    alpha = pcfg.get("lora_alpha", 8)
    for pattern, value in (pcfg.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if pcfg.get("use_rslora") else alpha / rank
