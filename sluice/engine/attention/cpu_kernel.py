"""Load the CPU paged attention kernel (cpu_attention.c), built by sluice.engine.native, and
call it on tensors.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from sluice.engine import native

SOURCE = Path(__file__).with_name("cpu_attention.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_BLOCK_SIZE = MAX_HEAD_DIM = 256  # cpu_attention.c's MAX_BLOCK and MAX_DIM


def _flags() -> list[str]:
    # Reassociation lets the dot products reduce as a tree instead of lane by lane (a serial
    # chain of scalar adds, 3x slower per layer); not -ffast-math as a whole, which would
    # also assume no infinities or NaNs where a bad input must still show as NaN.
    return ["-O3", native.arch_flag(), "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
            "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here (logged once)."""
    path = native.build(SOURCE, _flags())
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    fn = lib.sluice_paged_attention
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float,
                   i32, i32]
    fn.restype = i32
    return lib


def supports(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    return dtype in DTYPES and block_size <= MAX_BLOCK_SIZE and head_dim <= MAX_HEAD_DIM


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, out: torch.Tensor,
                    kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_rows: torch.Tensor,
                    q_starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> None:
    """Writes out[rows of the listed items] (q, out: [num_tokens, heads, head_dim]).

    seq_rows, q_starts, q_lens, seq_lens: int32 [num_items], each item's row in block_tables,
    first query row, query rows, and context length up to its last query row. An item is a
    sequence's whole step or, for a prefill chunk, a tile of its rows.
    """
    _, _, kv_heads, block_size, head_dim = kv_cache.shape
    assert q.is_contiguous() and out.is_contiguous() and kv_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert q.dtype == out.dtype == kv_cache.dtype and supports(q.dtype, block_size, head_dim)
    for t in (seq_rows, q_starts, q_lens, seq_lens):
        assert t.dtype == torch.int32 and t.is_contiguous()
    status = lib.sluice_paged_attention(
        q.data_ptr(), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_rows.data_ptr(),
        q_starts.data_ptr(), q_lens.data_ptr(), seq_lens.data_ptr(), len(seq_rows),
        q.shape[1], kv_heads, head_dim, block_size, scale, DTYPES[q.dtype],
        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"CPU paged attention kernel failed ({status})")
