"""The model families the engine runs, keyed by the Hugging Face `architectures` name (as
vLLM's registry is): the module in `sluice.engine.models` and the class. A new family is
its file plus a line here. Configs without `architectures` (named dummy shapes) are looked
up by `model_type`. Leaf module: the model files are imported only when a class is asked
for, so the config can check names without torch.
"""

from __future__ import annotations

import importlib

# architectures name -> (module in sluice.engine.models, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}
# model_type -> architectures name, for configs that name no architecture
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def architecture_of(hf_config: dict) -> str:
    """The family a transformers config dict names (ValueError listing the supported ones)."""
    named = hf_config.get("architectures") or []
    for arch in named:
        if arch in _MODELS:
            return arch
    if not named and hf_config.get("model_type", "llama") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[hf_config.get("model_type", "llama")]
    what = f"architectures {named}" if named else f"model_type {hf_config.get('model_type')!r}"
    raise ValueError(f"unsupported model: {what}; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def model_class(architecture: str) -> type:
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"sluice.engine.models.{module}"), name)
