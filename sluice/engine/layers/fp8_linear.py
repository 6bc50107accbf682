"""Linear layers over float8 e4m3 weights, W8A8 (`--quantization fp8`, vLLM's method).

Where the weights come from:
- a checkpoint that stores them (config.json `quantization_config.quant_method: fp8`):
  e4m3 `weight` with a per-tensor `weight_scale`, or, with `weight_block_size: [128, 128]`
  (Qwen3-FP8, DeepSeek), a `weight_scale_inv` per 128 x 128 block; weight = e4m3 x scale;
- a bf16 / float32 checkpoint served with `--quantization fp8`: quantized at load, one
  scale per output channel (its largest magnitude to 448), vLLM's online fp8.

How they are multiplied: on a GPU with float8 tensor cores (sm_89 and later) the e4m3
weights stay as they are; each call quantizes its activations per token (per token and
128-group with block scales) and runs fp8_scaled_mm's kernel. Elsewhere (CPUs, older GPUs)
the weights are dequantized once, after loading, to the engine dtype and multiplied as a
plain `Linear`: the checkpoint's values, not its size. Activations are always quantized
dynamically; a checkpoint's static `input_scale` is read and not used (a per-token scale
is never coarser). One rank, no adapters (the config refuses the rest).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from sluice.engine.layers.fp8_scaled_mm import FP8, GROUP, quantize_per_token, scaled_mm
from sluice.engine.layers.linear import Linear
from sluice.engine.layers.parallel_linear import check_shape


@dataclass(frozen=True)
class FP8Quant:
    """A QuantMethod (layers/quantization.py). dtype: the engine's (activations, dequantized
    weights); block: 128 for 128 x 128 block scales, 0 for one scale per output channel (a
    per-tensor scale is that, repeated); stored: the checkpoint holds e4m3 weights and
    scales (False: quantize at load)."""

    dtype: torch.dtype
    block: int = 0
    stored: bool = True

    def __post_init__(self) -> None:
        assert self.block in (0, GROUP), f"block scales of {self.block}: only {GROUP}"
        assert self.stored or not self.block, "quantizing at load uses channel scales"

    def linear(self, in_features: int, parts: dict[str, int], bias: bool) -> FP8Linear:
        return FP8Linear(in_features, parts, bias, self)

    def embedding(self, vocab_size: int, hidden_size: int) -> None:
        return None  # checkpoints keep it in bf16

    def lm_head(self, embedding: nn.Module, tied: bool) -> None:
        return None


def uses_fp8_kernel(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    """A projection whose output is its parts (transformers' names) concatenated."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, quant: FP8Quant):
        super().__init__()
        self.in_features, self.parts, self.quant = in_features, dict(parts), quant
        self.out_features = out = sum(parts.values())
        self.offsets = dict(zip(parts, itertools.accumulate(parts.values(), initial=0)))
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=FP8), requires_grad=False)
        if quant.block:
            shape = (-(-out // quant.block), -(-in_features // quant.block))
            self.scale_name = "weight_scale_inv"
        else:
            shape, self.scale_name = (out,), "weight_scale"
        # float32 whatever the engine dtype (a buffer: the loader casts parameters only)
        self.register_buffer(self.scale_name, torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        self.loaded: set[tuple[str, str]] = set()
        self.dense: Linear | None = None  # the dequantized weights, where no fp8 kernel runs

    def weight_loader(self, param: str, full, part: str) -> None:
        off, size = self.offsets[part], self.parts[part]
        scale = getattr(self, self.scale_name)
        with torch.no_grad():
            if param == "weight":
                check_shape(full, (size, self.in_features), f"{part}.weight")
                w = full[:]
                if self.quant.stored:
                    assert w.dtype == FP8, f"{part}.weight is {w.dtype}, the checkpoint fp8"
                    self.weight[off:off + size] = w
                else:
                    q, s = quantize_per_token(w)  # a weight row is an output channel
                    self.weight[off:off + size], scale[off:off + size] = q, s.view(-1)
            elif param == "weight_scale" == self.scale_name:  # per tensor, or per channel
                s = full[...].float().reshape(-1)
                scale[off:off + size] = s if s.numel() == size else s.expand(size)
            elif param == "weight_scale_inv" == self.scale_name:
                b = self.quant.block
                assert off % b == 0, f"{part} starts inside a {b}-row scale block"
                rows = -(-size // b)
                check_shape(full, (rows, scale.shape[1]), f"{part}.weight_scale_inv")
                scale[off // b:off // b + rows] = full[:].float()
            elif param == "input_scale":
                return  # activations are quantized per token (the module docstring)
            elif param == "bias" and self.bias is not None:
                check_shape(full, (size,), f"{part}.bias")
                self.bias[off:off + size] = full[:]
            else:
                raise ValueError(f"unexpected parameter {part}.{param} for an fp8 layer")
        self.loaded.add((param, part))

    def process_weights_after_loading(self) -> None:
        """Keep the e4m3 weights where the kernel runs; elsewhere dequantize them once."""
        names = ["weight"] + ([self.scale_name] if self.quant.stored else [])
        names += ["bias"] if self.bias is not None else []
        missing = {(n, p) for n in names for p in self.parts} - self.loaded
        assert not missing, f"fp8 layer missing {sorted(missing)}"
        if uses_fp8_kernel(self.weight.device):
            return
        dtype, bias = self.quant.dtype, self.bias
        with torch.no_grad():
            self.dense = Linear.from_weights(self.dequantized().to(dtype),
                                             None if bias is None else bias.to(dtype))
        del self.weight

    def dequantized(self) -> torch.Tensor:
        """The weights as float32: e4m3 x their scale."""
        scale = getattr(self, self.scale_name)
        if self.quant.block:
            b = self.quant.block
            scale = scale.repeat_interleave(b, 0)[:self.out_features].repeat_interleave(
                b, 1)[:, :self.in_features]
            return self.weight.float() * scale
        return self.weight.float() * scale.view(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x)
        rows = x.reshape(-1, self.in_features)
        q, s = quantize_per_token(rows, self.quant.block)
        out = scaled_mm(q, s, self.weight, getattr(self, self.scale_name), x.dtype, self.bias,
                        self.quant.block)
        return out.view(*x.shape[:-1], self.out_features)


def fp8_quant(hf_config: dict, requested: str | None, dtype: torch.dtype) -> FP8Quant | None:
    """The fp8 method a checkpoint declares (config.json's quantization_config), or
    `--quantization fp8` asked of an unquantized one; None otherwise."""
    qc = hf_config.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        block = qc.get("weight_block_size")
        if block not in (None, [GROUP, GROUP]):
            raise ValueError(f"fp8 weight_block_size {block}: only [{GROUP}, {GROUP}]")
        return FP8Quant(dtype, GROUP if block else 0)
    if requested == "fp8":
        if qc:
            raise ValueError(f"--quantization fp8 on a {qc.get('quant_method')!r} checkpoint")
        return FP8Quant(dtype, stored=False)
    return None


