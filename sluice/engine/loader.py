"""Build a CausalLM from a Hugging Face folder, a GGUF file, or random weights.

Weights arrive under transformers' names, one tensor at a time, and each goes to its
module's `weight_loader` (layers/parallel_linear.py), which copies this rank's share: the
q/k/v and gate/up parts land in their rows of the fused `qkv_proj` and `gate_up_proj`.
Safetensors tensors arrive as slices, so a tensor-parallel rank reads its shard only; a
GGUF tensor is dequantized whole, then sliced. Random (dummy) weights are drawn for the
whole model in one order and sharded the same way, so every tensor-parallel size holds
the same model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from sluice.engine.attention.backend import AttentionBackend
from sluice.engine.config import ModelConfig
from sluice.engine.distributed.parallel_state import SINGLE, TPGroup
from sluice.engine.layers.parallel_linear import ColumnParallelLinear, check_shape
from sluice.engine.layers.quantization import quant_method
from sluice.engine.lora.layers import LoRAContext
from sluice.engine.models.causal_lm import CausalLM
from sluice.engine.models.registry import model_class
from sluice.engine.shapes import SHAPES

_FUSED = {  # a checkpoint module -> the fused module it is a part of
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
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
               lora: LoRAContext | None = None, tp: TPGroup = SINGLE,
               quantization: str | None = None) -> CausalLM:
    """Build the model (with LoRA layers given a context; this rank's shard given a
    tensor-parallel group; the layers of `--quantization`'s method, or of the one the
    checkpoint declares); `weights` (transformers names) overrides the checkpoint or
    dummy init."""
    hf_config = read_hf_config(model, load_format)
    cfg = ModelConfig.from_hf(hf_config)
    quant = quant_method(quantization, hf_config, dtype, tp)
    if quant is not None and lora is not None:  # (a checkpoint may declare it: not the config)
        raise ValueError(f"a {type(quant).__name__} model is served without LoRA adapters: "
                         "drop --enable-lora")
    with torch.device(device):
        lm = model_class(cfg.architecture)(cfg, backend, lora=lora, tp=tp, quant=quant)
    # Parameters take the engine dtype (fp8 weights stay e4m3); rotary frequencies and
    # quantization scales (buffers) stay float32.
    for p in lm.parameters():
        if p.dtype != torch.float8_e4m3fn:
            p.data = p.data.to(dtype)
    if weights is None:
        if load_format == "dummy":
            weights = _dummy_weights(cfg, backend, dtype, device, seed)
        elif model.endswith(".gguf"):
            from sluice.engine.gguf_loader import load_gguf
            weights = load_gguf(model)[1]
        else:
            weights = _iter_safetensors(model)
    _load_weights(lm, weights)
    # An inference engine: no parameter takes part in autograd, whatever mode a caller
    # runs the model in (an input that requires grad sends the packed linears' oneDNN op
    # through autograd's fallback: ~700x slower).
    lm.requires_grad_(False)
    for module in lm.modules():  # (after loading: a kernel may reorder the weights)
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return lm.eval()


def _iter_safetensors(folder: str) -> Iterator[tuple[str, object]]:
    """(name, safetensors slice): a loader indexes the slice and reads that part only."""
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield key, f.get_slice(key)


def _load_weights(lm: CausalLM, weights: Iterator[tuple[str, object]]) -> None:
    modules = dict(lm.named_modules())
    params = dict(lm.named_parameters(remove_duplicate=False))
    written: dict[str, set[str]] = {}  # parameter -> the checkpoint parts written into it
    tied = lm.config.tie_word_embeddings
    for name, full in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and tied):
            continue
        module_name, _, param = name.rpartition(".")
        owner, _, part = module_name.rpartition(".")
        target = f"{owner}.{_FUSED[part]}" if part in _FUSED else module_name
        module = modules.get(target)
        if f"{target}.{param}" not in params and not hasattr(module, "weight_loader"):
            raise ValueError(f"unexpected weight {name!r} for {lm.config.model_type}")
        if hasattr(module, "weight_loader"):
            module.weight_loader(param, full, part)
        else:
            dest = getattr(module, param)
            check_shape(full, tuple(dest.shape), name)
            with torch.no_grad():
                dest.copy_(full[:])
        written.setdefault(f"{target}.{param}", set()).add(part)
    if tied:
        written["lm_head.weight"] = {"lm_head"}
    missing = []
    for pname in params:
        module = modules[pname.rpartition(".")[0]]
        parts = written.get(pname)
        if parts is None or (isinstance(module, ColumnParallelLinear)
                             and parts != set(module.shards)):
            missing.append(pname)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)}")


def _dummy_weights(cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                   device: torch.device, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Small random weights (std 0.02, norms 1) for the whole, unsharded model, under
    transformers' names, reproducible from the seed: drawn in the order of the
    single-rank model's parameters (a fused one whole, then split into its parts)."""
    with torch.device("meta"):
        whole = model_class(cfg.architecture)(cfg, backend)
    modules = dict(whole.named_modules())
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in whole.named_parameters():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if "norm" in name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        module_name, _, param = name.rpartition(".")
        module = modules[module_name]
        if not isinstance(module, ColumnParallelLinear) or len(module.shards) == 1:
            yield name, t
            continue
        owner = module_name.rpartition(".")[0]
        for part, shard in module.shards.items():
            off = module.local_offsets[part]
            yield f"{owner}.{part}.{param}", t[off:off + shard.size]
