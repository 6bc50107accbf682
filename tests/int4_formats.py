"""GPTQ and AWQ int4 tensors as their specification states them, written apart from the
engine's code: AutoGPTQ's and AutoAWQ's packers (`pack`), and a dequantization that reads
each code from its word and nibble (`reference`), as vLLM's readers do."""

from __future__ import annotations

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's gemm packer: nibble j <- column AWQ_ORDER[j]


def pack(codes: torch.Tensor, along_out: bool, awq: bool = False) -> torch.Tensor:
    """codes [in, out] (0..15) -> int32 words: eight codes of consecutive inputs (GPTQ's
    qweight) or outputs (qzeros, AWQ's qweight), code t of a word in bits 4t (AWQ: code t
    is column AWQ_ORDER[t] of the eight)."""
    c = codes.long() if along_out else codes.long().T
    groups = c.unflatten(1, (-1, 8))
    order = AWQ_ORDER if awq else list(range(8))
    word = sum(groups[..., order[t]] << (4 * t) for t in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # two's complement
    return (word if along_out else word.T).contiguous()


def _code(words: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, nibble: torch.Tensor):
    return (words[rows][:, cols].long() >> (4 * nibble)) & 0xF


def reference(fmt: str, qweight, qzeros, scales, group: int, zero_offset: int):
    """W [out, in] in float32: W[o, i] = (q[i, o] - z[i // G, o]) x s[i // G, o], each code
    read on its own from its word and nibble."""
    n = scales.shape[1]
    k = qweight.shape[0] * (8 if fmt == "gptq" else 1)
    i, o = torch.arange(k), torch.arange(n)
    if fmt == "gptq":  # word i // 8 of column o, nibble i % 8
        q = _code(qweight, i // 8, o, (i % 8)[:, None])
        zero_nibble = o % 8
    else:  # word o // 8 of row i, the nibble that holds column o % 8
        zero_nibble = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])[o % 8]
        q = _code(qweight, i, o // 8, zero_nibble[None, :])
    z = _code(qzeros, i // group, o // 8, zero_nibble[None, :]) + zero_offset
    return ((q - z) * scales.float()[i // group]).T
