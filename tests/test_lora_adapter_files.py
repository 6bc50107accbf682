"""PEFT adapter folders the engine refuses, each with a message that names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sluice.engine.config import ModelConfig
from sluice.engine.loader import read_hf_config
from sluice.engine.lora.config import LoRAConfig, LoRAModulePath
from sluice.engine.lora.peft_adapter import LoRAError, load_peft_adapter

CFG = ModelConfig.from_hf(read_hf_config("tiny-llama", "dummy"))  # hidden 64, kv 32, mlp 128
KEY = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"


def adapter(tmp_path, tensors=None, **config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    tensors = tensors if tensors is not None else {
        KEY.format(0, "q_proj", "A"): torch.ones(4, 64), KEY.format(0, "q_proj", "B"): torch.ones(64, 4)}
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    return str(tmp_path)


def test_a_good_adapter_folds_its_scaling_into_b(tmp_path):
    w = load_peft_adapter(adapter(tmp_path), CFG, 16, torch.float32)
    a, b = w.modules[(0, "q_proj")]
    assert w.rank == 4 and a.shape == (4, 64) and torch.all(b == 2.0)  # alpha 8 / r 4
    rs = load_peft_adapter(adapter(tmp_path, use_rslora=True), CFG, 16, torch.float32)
    assert torch.all(rs.modules[(0, "q_proj")][1] == 4.0)  # alpha / sqrt(r)


@pytest.mark.parametrize("tensors, config, message", [
    ({KEY.format(0, "q_proj", "A"): torch.ones(4, 32), KEY.format(0, "q_proj", "B"): torch.ones(64, 4)},
     {}, r"layer 0 q_proj: lora_A \(4, 32\) and lora_B \(64, 4\) do not fit"),
    ({KEY.format(0, "k_proj", "A"): torch.ones(32, 64), KEY.format(0, "k_proj", "B"): torch.ones(32, 32)},
     {}, "rank 32 is over --max-lora-rank 16"),
    ({KEY.format(5, "q_proj", "A"): torch.ones(4, 64), KEY.format(5, "q_proj", "B"): torch.ones(64, 4)},
     {}, "the base model has 2 layers"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(4, 64)}, {}, "lora_A and lora_B must both"),
    ({"base_model.model.lm_head.lora_A.weight": torch.ones(4, 64)}, {}, "only those are served"),
    (None, {"use_dora": True}, "DoRA adapters are not supported"),
    (None, {"bias": "all"}, "bias 'all' is not supported"),
    (None, {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    (None, {"peft_type": "IA3"}, "is not LORA"),
])
def test_adapters_this_engine_cannot_serve_are_refused(tmp_path, tensors, config, message):
    with pytest.raises(LoRAError, match=message):
        load_peft_adapter(adapter(tmp_path, tensors, **config), CFG, 16, torch.float32)


def test_missing_and_unreadable_files_are_refused(tmp_path):
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_peft_adapter(str(tmp_path / "nowhere"), CFG, 16, torch.float32)
    adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(LoRAError, match="adapter_model.bin is a pickle"):
        load_peft_adapter(str(tmp_path), CFG, 16, torch.float32)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(LoRAError, match="not a readable safetensors file"):
        load_peft_adapter(str(tmp_path), CFG, 16, torch.float32)
    (tmp_path / "adapter_config.json").write_text("{nope")
    with pytest.raises(LoRAError, match="not readable JSON"):
        load_peft_adapter(str(tmp_path), CFG, 16, torch.float32)


def test_lora_flags_parse_as_vllm_writes_them():
    assert LoRAModulePath.parse("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert LoRAModulePath.parse('{"name": "sql", "path": "/a", "base_model_name": "m"}') == \
        LoRAModulePath("sql", "/a", "m")
    for bad, message in [("sql", "name=path"), ("a b=/x", "invalid LoRA adapter name"),
                         ('{"name": 1}', '"name" and "path"'), ('{"name": "a", "path": "/x", "rank": 8}',
                                                               "unknown keys")]:
        with pytest.raises(ValueError, match=message):
            LoRAModulePath.parse(bad)
    with pytest.raises(ValueError, match="--max-lora-rank must be one of"):
        LoRAConfig(max_lora_rank=12)
    with pytest.raises(ValueError, match="--max-cpu-loras must be at least --max-loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)


def test_a_hub_repository_id_resolves_through_the_hub_cache(tmp_path):
    """vLLM's lora_path may name a Hub repository: fetched into (here: found offline in) the
    Hub cache; a repository that is nowhere is refused by name."""
    import os
    import subprocess
    import sys

    from lora_adapters import hub_cache

    adapter(tmp_path / "src")
    cache = hub_cache(tmp_path / "hub", "org/sql-adapter", tmp_path / "src")
    code = ("from sluice.engine.lora.peft_adapter import load_peft_adapter as load, LoRAError\n"
            "from sluice.engine.config import ModelConfig\n"
            "from sluice.engine.loader import read_hf_config\n"
            "import torch\n"
            "cfg = ModelConfig.from_hf(read_hf_config('tiny-llama', 'dummy'))\n"
            "print(load('org/sql-adapter', cfg, 16, torch.float32).rank)\n"
            "try:\n"
            "    load('org/missing', cfg, 16, torch.float32)\n"
            "except LoRAError as exc:\n"
            "    print(exc)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    assert out[0] == "4"
    assert out[1].startswith("org/missing: no such folder, and no Hugging Face Hub adapter")
