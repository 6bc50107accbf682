"""Default sampling parameters from a model's generation_config.json (vLLM's
`--generation-config auto`): what the model's authors recommend applies to every
request field the client leaves out."""

from __future__ import annotations

import json
import os

# generation_config.json field -> request field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_sampling_defaults(setting: str, model_path: str) -> dict:
    """`auto`: the model folder's generation_config.json (none for a GGUF or a dummy);
    `vllm`: no model defaults; otherwise a folder holding a generation_config.json."""
    if setting == "vllm":
        return {}
    folder = model_path if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isdir(folder) or not os.path.isfile(path):
        if setting != "auto":
            raise FileNotFoundError(f"no generation_config.json in {setting!r}")
        return {}
    with open(path) as f:
        config = json.load(f)
    if config.get("do_sample") is False:  # the authors ask for greedy decoding
        config = {**config, "temperature": 0.0}
    return {ours: config[theirs] for theirs, ours in _FIELDS.items() if theirs in config}
