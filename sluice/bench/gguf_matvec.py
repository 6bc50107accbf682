"""One decode-shaped matvec (1 row, bf16 activations, one thread) through the GGUF kernels
(Q4_K, Q5_K, Q6_K, Q4_1) and through torch's bf16 linear of the same weights dequantized,
per kernel build: the median of `--calls` calls (2,000) after a tenth as many to warm up,
per in x out shape. A K-quant row is whole superblocks of 256, so a 576-wide input
(SmolLM2's hidden size) has no K-quant form (llama.cpp falls back to Q5_0 there):
768 x 1536 stands in for it.

    sluice bench gguf [--isa ISA ...]     (default: every build this CPU runs)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from sluice.engine import kernels

SHAPES = [(576, 1536), (768, 1536), (1536, 576)]  # (in, out): gate/up, its K-quant stand-in, down
Q = GGMLQuantizationType
TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_1)


def blocks(qtype, k: int, n: int, rng: np.random.Generator) -> np.ndarray | None:
    if qtype == Q.Q4_1:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    values, size = GGML_QUANT_SIZES[qtype]
    if k % values:
        return None
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    scales = np.full((n, k // values, 2), 1e-3, np.float16).view(np.uint8)  # d, dmin
    if qtype == Q.Q6_K:
        raw[..., 208:210] = scales[..., :2]
    else:
        raw[..., 0:4] = scales
    return raw.reshape(n, -1)


def median_ms(fn, *args, calls: int) -> float:
    for _ in range(max(calls // 10, 1)):  # warm-up
        fn(*args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isa", nargs="*", default=None,
                   help="kernel builds to time (default: every one this CPU runs)")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per figure (median)")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    ops = kernels.ops()
    if ops is None:
        raise SystemExit("the engine's kernels are not built (sluice.engine._C)")
    rng = np.random.default_rng(0)
    isas = args.isa or list(ops.cpu_isas())
    print("one thread, ms per call; bf16: torch's linear of the dequantized weights")
    for k, n in SHAPES:
        x = torch.randn(1, k).to(torch.bfloat16)
        made = {t: blocks(t, k, n, rng) for t in TYPES}
        w16 = torch.from_numpy(dequantize(made[Q.Q4_1], Q.Q4_1).reshape(n, k)).to(torch.bfloat16)
        print(f"{k} x {n}: bf16 {median_ms(F.linear, x, w16, calls=args.calls):.4f}")
        for isa in isas:
            ops.select_cpu_isa(isa)
            row = []
            for qtype, b in made.items():
                ms = None if b is None else median_ms(ops.gguf_linear, x, torch.from_numpy(b),
                                                      int(qtype), calls=args.calls)
                row.append(f"{qtype.name} " + ("-" if ms is None else f"{ms:.4f}"))
            print(f"  {isa:>10}: " + ", ".join(row))
    return 0
