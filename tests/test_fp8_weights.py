"""fp8 W8A8 weights (layers/fp8_linear.py): a checkpoint that stores e4m3 weights with
per-tensor or 128 x 128 block scales (config.json's quant_method fp8), and a float one
quantized at load (`--quantization fp8`). On the CPU the layers multiply the dequantized
weights: the engine's tokens equal a plain engine's over the same dequantized values. The
GPU path (activations quantized per token, the Triton kernel) runs in the interpreter."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.config import CacheConfig, EngineConfig, ParallelConfig
from sluice.engine.layers import fp8_linear
from sluice.engine.layers.fp8_linear import FP8Linear
from sluice.engine.layers.fp8_scaled_mm import FP8, quantize_per_token
from sluice.engine.layers.quantization import quant_method
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.loader import load_model
from sluice.engine.lora.config import LoRAConfig
from sluice.engine.sampling_params import SamplingParams

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 17, 99, 254, 3], [1, 400, 8, 8, 8, 61, 77]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _block_scales(w: torch.Tensor) -> torch.Tensor:
    blocks = w.abs().unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).amax(dim=(1, 3))
    return blocks / 448


def _expand(scale: torch.Tensor, shape) -> torch.Tensor:
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]


def _fp8_checkpoint(float_model: Path, folder: Path, block: bool):
    """float_model's projections as e4m3 + scales (what llm-compressor and Qwen's FP8
    releases store); returns the folder and the dequantized tensors by name."""
    tensors = load_file(str(float_model / "model.safetensors"))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if not any(p in name for p in PROJECTIONS):
            out[name] = t
            continue
        base = name.removesuffix(".weight")
        if block:
            scale = _block_scales(t)
            q = (t / _expand(scale, t.shape)).clamp(-448, 448).to(FP8)
            out[base + ".weight_scale_inv"] = scale
            dequantized[name] = q.float() * _expand(scale, t.shape)
        else:
            scale = t.abs().max() / 448
            q = (t / scale).to(FP8)
            out[base + ".weight_scale"] = scale
            out[base + ".input_scale"] = torch.tensor(0.01)  # static: read, not used
            dequantized[name] = q.float() * scale
        out[name] = q
    folder.mkdir(parents=True)
    save_file(out, str(folder / "model.safetensors"))
    cfg = json.loads((float_model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"} | (
        {"weight_block_size": [128, 128]} if block else {})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, dequantized


def _generate(model: str, weights=None, **kw) -> list:
    engine = LLMEngine(EngineConfig(model=model, served_model_name="m", dtype="float32",
                                    cache=CacheConfig(num_blocks=64), **kw))
    if weights is not None:  # the same model with these tensors in place of the checkpoint's
        engine.model.load_state_dict(weights, strict=False)
    return engine.generate(PROMPTS, GREEDY)


def _plain_with(float_model: Path, dequantized: dict[str, torch.Tensor]):
    """The float model with `dequantized` projections: fused as the engine fuses them."""
    lm = load_model(str(float_model), "auto", TorchAttentionBackend(), torch.float32,
                    torch.device("cpu"), weights=iter({
                        **load_file(str(float_model / "model.safetensors")),
                        **dequantized}.items()))
    return lm.state_dict()


@pytest.mark.parametrize("block", [False, True], ids=["per-tensor", "128-blocks"])
def test_a_stored_fp8_checkpoint_serves_its_dequantized_weights(float_model, tmp_path, block):
    folder, dequantized = _fp8_checkpoint(float_model, tmp_path / "fp8", block)
    lm = load_model(str(folder), "auto", TorchAttentionBackend(), torch.float32,
                    torch.device("cpu"))
    qkv = lm.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, FP8Linear) and qkv.quant.block == (128 if block else 0)
    want = torch.cat([dequantized[f"model.layers.0.self_attn.{p}.weight"]
                      for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.dense.weight, want)  # e4m3 x scale, exactly
    assert _generate(str(folder)) == _generate(str(float_model),
                                               _plain_with(float_model, dequantized))


def test_quantization_fp8_quantizes_a_float_checkpoint_per_channel(float_model):
    dequantized = {}
    for name, t in load_file(str(float_model / "model.safetensors")).items():
        if any(p in name for p in PROJECTIONS):
            q, s = quantize_per_token(t)
            dequantized[name] = q.float() * s
    engine = LLMEngine(EngineConfig(model=str(float_model), served_model_name="m",
                                    dtype="float32", quantization="fp8",
                                    cache=CacheConfig(num_blocks=64)))
    up = engine.model.model.layers[1].mlp.gate_up_proj
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(up.dense.weight[512:], dequantized[name])
    assert not torch.equal(dequantized[name], load_file(str(float_model /
                                                             "model.safetensors"))[name])
    got = engine.generate(PROMPTS, GREEDY)
    assert got == _generate(str(float_model), _plain_with(float_model, dequantized))


@pytest.mark.slow  # Triton's interpreter on CPU
@pytest.mark.parametrize("block", [False, True], ids=["per-tensor", "128-blocks"])
def test_the_gpu_path_quantizes_activations_per_token(float_model, tmp_path, monkeypatch,
                                                      block):
    """Where the fp8 kernel runs, the layer keeps e4m3 weights and multiplies activations
    quantized per token (per 128-group with block scales) by them."""
    monkeypatch.setattr(fp8_linear, "uses_fp8_kernel", lambda device: True)
    folder, _ = _fp8_checkpoint(float_model, tmp_path / "fp8", block)
    lm = load_model(str(folder), "auto", TorchAttentionBackend(), torch.float32,
                    torch.device("cpu"))
    down = lm.model.layers[1].mlp.down_proj
    assert down.dense is None and down.weight.dtype == FP8
    x = torch.randn(5, down.in_features, generator=torch.Generator().manual_seed(1))
    q, s = quantize_per_token(x, 128 if block else 0)
    xq = q.float() * (s.repeat_interleave(128, 1) if block else s)
    want = xq @ down.dequantized().T  # the same products, summed in another order
    torch.testing.assert_close(down(x), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_what_fp8_refuses(float_model, tmp_path):
    folder, _ = _fp8_checkpoint(float_model, tmp_path / "fp8", block=False)
    with pytest.raises(ValueError, match="served on one rank"):
        quant_method(None, json.loads((folder / "config.json").read_text()), torch.float32,
                     SimpleNamespace(world_size=2))
    with pytest.raises(ValueError, match="served without LoRA adapters"):
        LLMEngine(EngineConfig(model=str(folder), served_model_name="m", lora=LoRAConfig(),
                               cache=CacheConfig(num_blocks=16)))
    with pytest.raises(ValueError, match="not supported with --enable-lora or --tensor"):
        EngineConfig(model=str(float_model), served_model_name="m", quantization="fp8",
                     parallel=ParallelConfig(2))
    with pytest.raises(ValueError, match="fp8 a Hugging Face folder"):
        EngineConfig(model="m.gguf", served_model_name="m", quantization="fp8")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\]: only \[128, 128\]"):
        load_model(str(folder), "auto", TorchAttentionBackend(), torch.float32,
                   torch.device("cpu"))
