"""GPTQ and AWQ int4 weights (layers/int4_linear.py).

The formats are pinned by a reference written from their specification (int4_formats.py),
checked here on hand-packed words; a tiny random Llama is quantized here per group and
saved as each checkpoint. On the CPU the engine multiplies the dequantized weights: they
equal the reference exactly, and the tokens equal a plain engine's over the same values.
The layer's CUDA path runs its Triton kernel in the interpreter (the kernel alone:
test_int4_matmul.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from int4_formats import pack, reference
from safetensors.torch import load_file, save_file
from test_fp8_weights import _generate, _plain_with

from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.config import EngineConfig, ParallelConfig
from sluice.engine.layers import int4_linear
from sluice.engine.layers.int4_linear import Int4Linear, unpack
from sluice.engine.layers.int4_matmul import AWQ, GPTQ
from sluice.engine.layers.quantization import quant_method
from sluice.engine.loader import load_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_hand_packed_words_unpack_in_each_order():
    # nibbles 1, 2, ..., 8 from the lowest: GPTQ's order is the nibbles' own
    word = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)
    assert unpack(word, 0, GPTQ).view(-1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert unpack(word, 1, GPTQ).view(-1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # columns 1..8 packed by AWQ: nibble j holds column AWQ_ORDER[j], value AWQ_ORDER[j] + 1
    awq = torch.tensor([[0x86427531 - 2**32]], dtype=torch.int32)
    assert unpack(awq, 1, AWQ).view(-1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    cols = torch.arange(1, 9).view(1, 8)
    assert torch.equal(pack(cols, along_out=True, awq=True), awq)
    assert torch.equal(pack(cols, along_out=True), word)
    assert torch.equal(pack(cols.T, along_out=False), word)
    # the reference reads the same words: a GPTQ column of inputs 1..8, zero 1 (v1: 0 + 1)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    zeros = torch.zeros(1, 1, dtype=torch.int32)
    gptq_w = reference("gptq", word.expand(1, 8).contiguous(), zeros, scales, 8, 1)
    assert gptq_w[3].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    awq_w = reference("awq", awq.expand(8, 1).contiguous(), awq[:1], scales, 8, 0)
    assert awq_w.tolist() == [[0.0] * 8] * 8  # each column's codes equal its zero
    awq_w = reference("awq", awq.expand(8, 1).contiguous(), zeros, scales, 8, 0)
    assert awq_w[:, 0].tolist() == [0.5 * c for c in range(1, 9)]


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_the_packers_and_the_reference_agree_on_random_codes(fmt):
    gen = torch.Generator().manual_seed(3)
    k, n, group = 64, 48, 32
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen).half()
    awq = fmt == "awq"
    qweight = pack(codes, along_out=awq, awq=awq)
    assert qweight.shape == ((k, n // 8) if awq else (k // 8, n))
    w = reference(fmt, qweight, pack(zeros, along_out=True, awq=awq), scales, group, 0)
    want = (codes - zeros.repeat_interleave(group, 0)) * scales.float().repeat_interleave(
        group, 0)
    assert torch.equal(w, want.T)
    assert torch.equal(unpack(qweight, 1 if awq else 0, AWQ if awq else GPTQ), codes)


# -- checkpoints ---------------------------------------------------------------------------

def _quantize(w: torch.Tensor, group: int, min_zero: int):
    """w [out, in] -> codes [in, out], zeros and fp16 scales [in / G, out]: per group of
    inputs and output, min..max onto 0..15 (the zero at least min_zero)."""
    g = w.T.unflatten(0, (-1, group))  # [in / G, G, out]
    lo, hi = g.amin(dim=1).clamp(max=0), g.amax(dim=1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    s = scales.float()
    zeros = (-lo / s).round().clamp(min_zero, 15).long()
    codes = (g / s[:, None] + zeros[:, None]).round().clamp(0, 15).long()
    return codes.flatten(0, 1), zeros, scales


def _int4_checkpoint(float_model: Path, folder: Path, fmt: str, group: int):
    """float_model's projections as a GPTQ (v1, asymmetric, g_idx and AutoGPTQ's zero
    biases) or AWQ (gemm) checkpoint; returns the folder and the reference weights."""
    out, dequantized = {}, {}
    awq = fmt == "awq"
    for name, t in load_file(str(float_model / "model.safetensors")).items():
        if not any(p in name for p in PROJECTIONS):
            out[name] = t
            continue
        base = name.removesuffix(".weight")
        g = t.shape[1] if group == -1 else group
        codes, zeros, scales = _quantize(t, g, 0 if awq else 1)
        stored_zeros = zeros if awq else zeros - 1  # GPTQ v1 stores zero - 1
        tensors = {"qweight": pack(codes, along_out=awq, awq=awq),
                   "qzeros": pack(stored_zeros, along_out=True, awq=awq), "scales": scales}
        if not awq:
            tensors |= {"g_idx": torch.arange(t.shape[1], dtype=torch.int32) // g,
                        "bias": torch.zeros(t.shape[0], dtype=torch.float16)}
        out |= {f"{base}.{k}": v for k, v in tensors.items()}
        dequantized[name] = reference(fmt, tensors["qweight"], tensors["qzeros"], scales,
                                       g, 0 if awq else 1)
        want = (codes - zeros.repeat_interleave(g, 0)) * scales.float().repeat_interleave(g, 0)
        assert torch.equal(dequantized[name], want.T)  # the packing round-trips
        assert (dequantized[name] - t).abs().max() <= scales.float().max()  # a quantization
    folder.mkdir(parents=True)
    save_file(out, str(folder / "model.safetensors"))
    cfg = json.loads((float_model / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": group,
                                   "zero_point": True, "version": "gemm"} if awq else
                                  {"quant_method": "gptq", "bits": 4, "group_size": group,
                                   "desc_act": False, "sym": False, "checkpoint_format": "gptq"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, dequantized


FORMATS = [("gptq", 128), ("gptq", -1), ("awq", 64)]
IDS = ["gptq-g128", "gptq-per-row", "awq-g64"]


def _load(folder: Path):
    return load_model(str(folder), "auto", TorchAttentionBackend(), torch.float32,
                      torch.device("cpu"))


@pytest.mark.parametrize("fmt, group", FORMATS, ids=IDS)
def test_an_int4_checkpoint_serves_its_dequantized_weights(float_model, tmp_path, fmt, group):
    folder, dequantized = _int4_checkpoint(float_model, tmp_path / fmt, fmt, group)
    lm = _load(folder)
    qkv = lm.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.quant.packing == (AWQ if fmt == "awq" else GPTQ)
    want = torch.cat([dequantized[f"model.layers.0.self_attn.{p}.weight"]
                      for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.dense.weight, want)
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(lm.model.layers[1].mlp.down_proj.dense.weight, dequantized[down])
    assert _generate(str(folder)) == _generate(str(float_model),
                                               _plain_with(float_model, dequantized))


@pytest.mark.slow  # Triton's interpreter on CPU
@pytest.mark.parametrize("fmt, group", FORMATS, ids=IDS)
def test_the_gpu_path_multiplies_the_packed_weights(float_model, tmp_path, monkeypatch, fmt,
                                                    group):
    monkeypatch.setattr(int4_linear, "uses_int4_kernel", lambda device: True)
    folder, dequantized = _int4_checkpoint(float_model, tmp_path / fmt, fmt, group)
    lm = _load(folder)
    layer = lm.model.layers[1]
    gen = torch.Generator().manual_seed(1)
    for module, parts in ((layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                          (layer.mlp.down_proj, ("mlp.down_proj",))):
        assert module.dense is None and module.qweight.dtype == torch.int32
        w = torch.cat([dequantized[f"model.layers.1.{p}.weight"] for p in parts])
        x = torch.randn(2, 3, module.in_features, generator=gen)
        want = x @ w.T
        torch.testing.assert_close(module(x), want, rtol=0,
                                   atol=1e-5 * want.abs().max().item())


# -- refusals ------------------------------------------------------------------------------

def _config(qc: dict) -> dict:
    return {"quantization_config": qc}


GPTQ_OK = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
           "sym": True}
AWQ_OK = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
          "version": "gemm"}


@pytest.mark.parametrize("qc, match", [
    (GPTQ_OK | {"desc_act": True}, "gptq checkpoint with desc_act=True: only false"),
    (GPTQ_OK | {"bits": 8}, "gptq checkpoint with bits=8: only 4"),
    (GPTQ_OK | {"group_size": 100}, "group_size=100"),
    (GPTQ_OK | {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    (GPTQ_OK | {"lm_head": True}, "lm_head=True"),
    (AWQ_OK | {"version": "gemv"}, "awq checkpoint with version='gemv': only gemm"),
    (AWQ_OK | {"bits": 8}, "awq checkpoint with bits=8"),
    (AWQ_OK | {"zero_point": False}, "zero_point=False"),
])
def test_what_int4_refuses(qc, match):
    with pytest.raises(ValueError, match=match):
        quant_method(None, _config(qc), torch.float32, SimpleNamespace(world_size=1))


def test_the_checkpoint_decides_and_one_rank_serves(float_model):
    one, two = SimpleNamespace(world_size=1), SimpleNamespace(world_size=2)
    gptq = quant_method("gptq", _config(GPTQ_OK), torch.bfloat16, one)
    assert (gptq.packing, gptq.group, gptq.zero_offset) == (GPTQ, 128, 1)
    v2 = quant_method(None, _config(GPTQ_OK | {"checkpoint_format": "gptq_v2"}), torch.float32,
                      one)
    assert v2.zero_offset == 0
    awq = quant_method(None, _config(AWQ_OK | {"version": "GEMM"}), torch.float32, one)
    assert (awq.packing, awq.zero_offset) == (AWQ, 0)
    with pytest.raises(ValueError, match="--quantization awq on a 'gptq' checkpoint"):
        quant_method("awq", _config(GPTQ_OK), torch.float32, one)
    with pytest.raises(ValueError, match="--quantization gptq: the checkpoint declares no q"):
        quant_method("gptq", {}, torch.float32, one)
    with pytest.raises(ValueError, match="served on one rank"):
        quant_method(None, _config(AWQ_OK), torch.float32, two)
    with pytest.raises(ValueError, match="not supported with --enable-lora or --tensor"):
        EngineConfig(model=str(float_model), served_model_name="m", quantization="gptq",
                     parallel=ParallelConfig(2))


def test_an_act_order_g_idx_is_refused(float_model, tmp_path):
    folder, _ = _int4_checkpoint(float_model, tmp_path / "gptq", "gptq", 128)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.g_idx is not i // 128: an act-order"):
        _load(folder)
