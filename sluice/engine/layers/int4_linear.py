"""Linear layers over GPTQ and AWQ int4 weights, W4A16 (vLLM's `gptq` and `awq` methods).

A checkpoint declares them in config.json's `quantization_config`:
- `quant_method: gptq` (AutoGPTQ, GPTQModel, optimum): bits 4, `group_size` G or -1 (one
  group per input row), `sym` either way (the zeros are stored even when symmetric),
  `desc_act` false; `checkpoint_format` gptq (v1: the stored zero is the real one minus 1,
  vLLM adds 1) or gptq_v2 (stored as is). A `g_idx` tensor, where present, must be i // G;
- `quant_method: awq` (AutoAWQ): bits (`w_bit`) 4, `group_size` (`q_group_size`),
  `zero_point` true, `version` gemm.
The tensors (`qweight`, `qzeros`, `scales`) and their packings: layers/int4_matmul.py. Fused
parts (q/k/v, gate/up) are concatenated along the output. `--quantization gptq|awq` may
be given; the checkpoint's config decides, and a float checkpoint is not quantized at load.

How they are multiplied: on CUDA (sm_80 and later) the packed weights stay as they are and
int4_matmul's Triton kernel unpacks each tile inside the GEMM; elsewhere (CPUs) the weights are
dequantized once, after loading, to the engine dtype and multiplied as a plain `Linear`:
the checkpoint's values, not its size. Embedding and LM head are stored in float (AutoGPTQ
and AutoAWQ leave them so; `lm_head: true` is refused). One rank, no adapters.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from sluice.engine.layers.int4_matmul import AWQ, GPTQ, int4_mm
from sluice.engine.layers.linear import Linear
from sluice.engine.layers.parallel_linear import check_shape

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_ORDER[j]


@dataclass(frozen=True)
class Int4Quant:
    """A QuantMethod (layers/quantization.py). dtype: the engine's; packing: GPTQ or AWQ
    (int4_matmul); group: inputs per scale and zero (-1: all of a layer's); zero_offset:
    added to a stored zero (1 for GPTQ v1 checkpoints)."""

    dtype: torch.dtype
    packing: int
    group: int
    zero_offset: int = 0

    def linear(self, in_features: int, parts: dict[str, int], bias: bool) -> Int4Linear:
        return Int4Linear(in_features, parts, bias, self)

    def embedding(self, vocab_size: int, hidden_size: int) -> None:
        return None

    def lm_head(self, embedding: nn.Module, tied: bool) -> None:
        return None


def uses_int4_kernel(device: torch.device) -> bool:
    # Ampere and later: Triton's bf16 dots (an older GPU multiplies the dequantized weights)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def unpack(words: torch.Tensor, dim: int, packing: int = GPTQ) -> torch.Tensor:
    """int32 words -> their 4-bit codes (int32), eight per word along `dim`: lowest nibble
    first (GPTQ), or in AWQ's interleaved order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    codes = (words.unsqueeze(dim + 1) >> shifts.view([8] + [1] * (words.dim() - dim - 1))) & 0xF
    if packing == AWQ:  # nibble j -> column AWQ_ORDER[j]
        codes = codes.index_select(dim + 1, torch.tensor(
            [AWQ_ORDER.index(c) for c in range(8)], device=words.device))
    return codes.flatten(dim, dim + 1)


class Int4Linear(nn.Module):
    """A projection whose output is its parts (transformers' names) concatenated."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, quant: Int4Quant):
        super().__init__()
        self.in_features, self.parts, self.quant = in_features, dict(parts), quant
        self.out_features = out = sum(parts.values())
        self.offsets = dict(zip(parts, itertools.accumulate(parts.values(), initial=0)))
        self.group = g = in_features if quant.group == -1 else quant.group
        if in_features % g or g % 32 or any(size % 8 for size in parts.values()):
            raise ValueError(f"int4 layer {in_features} -> {parts}: inputs in groups of "
                             f"{g} (a multiple of 32), outputs in eights")
        qweight = (in_features // 8, out) if quant.packing == GPTQ else (in_features, out // 8)
        # buffers: the loader casts parameters to the engine dtype. Scales are kept in
        # float32, exact for the checkpoints' fp16 or bf16 (+1/16 of the packed bytes at G 128)
        self.register_buffer("qweight", torch.zeros(qweight, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(in_features // g, out // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(in_features // g, out))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        self.loaded: set[tuple[str, str]] = set()
        self.dense: Linear | None = None  # the dequantized weights, where no kernel runs

    def weight_loader(self, param: str, full, part: str) -> None:
        off, size, k, g = self.offsets[part], self.parts[part], self.in_features, self.group
        gptq = self.quant.packing == GPTQ
        with torch.no_grad():
            if param == "qweight":
                shape = (k // 8, size) if gptq else (k, size // 8)
                check_shape(full, shape, f"{part}.qweight")
                cols = slice(off, off + size) if gptq else slice(off // 8, (off + size) // 8)
                self.qweight[:, cols] = full[:].to(torch.int32)
            elif param == "qzeros":
                check_shape(full, (k // g, size // 8), f"{part}.qzeros")
                self.qzeros[:, off // 8:(off + size) // 8] = full[:].to(torch.int32)
            elif param == "scales":
                check_shape(full, (k // g, size), f"{part}.scales")
                self.scales[:, off:off + size] = full[:].float()
            elif param == "g_idx" and gptq:
                check_shape(full, (k,), f"{part}.g_idx")
                if not torch.equal(full[:].long(), torch.arange(k) // g):
                    raise ValueError(f"{part}.g_idx is not i // {g}: an act-order (desc_act) "
                                     "checkpoint, which is not supported")
            elif param == "bias" and self.bias is not None:
                check_shape(full, (size,), f"{part}.bias")
                self.bias[off:off + size] = full[:]
            elif param == "bias" and not full[:].any():
                return  # AutoGPTQ saves a zero bias for layers that have none (vLLM skips it)
            else:
                raise ValueError(f"unexpected parameter {part}.{param} for an int4 layer")
        self.loaded.add((param, part))

    def process_weights_after_loading(self) -> None:
        """Keep the packed weights where the kernel runs; elsewhere dequantize them once."""
        names = ["qweight", "qzeros", "scales"] + (["bias"] if self.bias is not None else [])
        missing = {(n, p) for n in names for p in self.parts} - self.loaded
        assert not missing, f"int4 layer missing {sorted(missing)}"
        if uses_int4_kernel(self.qweight.device):
            return
        dtype, bias = self.quant.dtype, self.bias
        with torch.no_grad():
            self.dense = Linear.from_weights(self.dequantized().to(dtype),
                                             None if bias is None else bias.to(dtype))
        del self.qweight, self.qzeros, self.scales

    def dequantized(self) -> torch.Tensor:
        """The weights [out, in] as float32: (code - zero) x scale."""
        p = self.quant.packing
        q = unpack(self.qweight, 0 if p == GPTQ else 1, p)  # [in, out]
        z = unpack(self.qzeros, 1, p) + self.quant.zero_offset  # [in / G, out]
        w = (q - z.repeat_interleave(self.group, 0)) * self.scales.repeat_interleave(
            self.group, 0)
        return w.T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x)
        rows = x.reshape(-1, self.in_features)
        out = int4_mm(rows, self.qweight, self.qzeros, self.scales, self.group,
                      self.quant.packing, self.quant.zero_offset, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def _refuse(method: str, setting: str, value, supported: str) -> ValueError:
    return ValueError(f"{method} checkpoint with {setting}={value!r}: only {supported} is "
                      "supported")


def int4_quant(hf_config: dict, requested: str | None, dtype: torch.dtype) -> Int4Quant | None:
    """The GPTQ or AWQ method a checkpoint declares (config.json's quantization_config);
    None for other checkpoints, unless `--quantization gptq|awq` asks for one."""
    qc = hf_config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method not in ("gptq", "awq"):
        if requested in ("gptq", "awq"):
            raise ValueError(f"--quantization {requested}: the checkpoint declares "
                             f"{method or 'no quantization'} (int4 weights are not made at load)")
        return None
    if requested not in (None, method):
        raise ValueError(f"--quantization {requested} on a {method!r} checkpoint")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(method, "bits", bits, "4")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise _refuse(method, "group_size", group, "-1 or a multiple of 32")
    if method == "gptq":
        if qc.get("desc_act"):
            raise _refuse(method, "desc_act", qc["desc_act"], "false")
        if qc.get("lm_head"):
            raise _refuse(method, "lm_head", qc["lm_head"], "false (a float LM head)")
        if qc.get("dynamic"):
            raise _refuse(method, "dynamic", qc["dynamic"], "none (one setting for all)")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse(method, "checkpoint_format", fmt, "gptq or gptq_v2")
        return Int4Quant(dtype, GPTQ, group, 1 if fmt == "gptq" else 0)
    if group == -1:
        raise _refuse(method, "group_size", group, "a multiple of 32")
    if qc.get("zero_point") is not True:
        raise _refuse(method, "zero_point", qc.get("zero_point"), "true")
    version = str(qc.get("version", "")).lower()
    if version != "gemm":
        raise _refuse(method, "version", qc.get("version"), "gemm")
    if qc.get("modules_to_not_convert"):
        raise _refuse(method, "modules_to_not_convert", qc["modules_to_not_convert"], "none")
    return Int4Quant(dtype, AWQ, group)
