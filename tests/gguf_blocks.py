"""Random but valid K-quant blocks (gguf-py dequantizes Q4_K, Q5_K and Q6_K but cannot
quantize them): every code, scale and min byte random, and half-precision d (Q4_K, Q5_K:
and dmin) drawn from a stated range, so each sub-block has its own scale and a kernel that
reads one from the wrong place gives other values."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# the codes' mean (Q4_K: 4 bits, Q5_K: 5): dmin = d x this centres a row's values on zero
_MEAN_CODE = {Q.Q4_K: 7.5, Q.Q5_K: 15.5}


def k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q,
                   d: tuple[float, float] = (1e-3, 1e-2), centred: bool = False) -> np.ndarray:
    """uint8 [rows, bytes per row]: d uniform in `d`; dmin uniform in `d` too, or, `centred`,
    d x the mean code (values of mean zero over the sub-blocks, as a trained layer's)."""
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % values == 0, (cols, values)
    shape = (rows, cols // values)
    raw = rng.integers(0, 256, size=(*shape, size), dtype=np.uint8)
    scale = rng.uniform(*d, size=shape)
    if qtype == Q.Q6_K:  # ql[128], qh[64], int8 scales[16], then d
        raw[..., 208:210] = _half_bytes(scale)
    else:  # d, dmin, 6-bit scales and mins[12], (Q5_K: qh[32]), qs[128]
        dmin = scale * _MEAN_CODE[qtype] if centred else rng.uniform(*d, size=shape)
        raw[..., 0:2] = _half_bytes(scale)
        raw[..., 2:4] = _half_bytes(dmin)
    return raw.reshape(rows, -1)


def _half_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)
