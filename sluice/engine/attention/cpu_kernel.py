"""Build and load the CPU paged attention kernel (cpu_attention.c) with the machine's C compiler.

Compiled once per source, compiler and CPU (`-march=native`: the cache key includes the
CPU's model and flags, so an image moved to another machine recompiles instead of faulting)
into `$XDG_CACHE_HOME/sluice/kernels`, else a per-user temporary folder; either is used only
when no other user can write to it. Engines starting together race safely: each compiles
to a private name and renames it into place. With no compiler, or a failed build, `load()`
returns None and the caller keeps the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_BLOCK_SIZE = MAX_HEAD_DIM = 256  # cpu_attention.c's MAX_BLOCK and MAX_DIM


def _flags() -> list[str]:
    arch = "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"
    # Reassociation lets the dot products reduce as a tree instead of lane by lane (a serial
    # chain of scalar adds, 3x slower per layer); not -ffast-math as a whole, which would
    # also assume no infinities or NaNs where a bad input must still show as NaN.
    return ["-O3", arch, "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
            "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keep}))


def _cache_dirs() -> list[Path]:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "sluice" / "kernels",
            Path(tempfile.gettempdir()) / f"sluice-kernels-{os.getuid()}"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _private(folder: Path) -> bool:
    """True when only this user can write to `folder` (created 0700 if missing): a shared
    temporary folder must not let another user plant the library this process loads."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(compiler: str) -> Path | None:
    try:
        version = subprocess.run([compiler, "--version"], check=False, capture_output=True,
                                 text=True).stdout
    except OSError as exc:
        log.warning("C compiler %s unusable (%s); using the PyTorch attention path",
                    compiler, exc)
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(_flags()),
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    for folder in _cache_dirs():
        if not _private(folder):
            continue
        target = folder / f"cpu_attention-{key}.so"
        if target.exists():
            return target
        try:
            fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
            os.close(fd)
        except OSError:
            continue
        result = subprocess.run([compiler, *_flags(), str(SOURCE), "-o", partial],
                                check=False, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(partial)
            log.warning("CPU attention kernel failed to compile (%s); using the PyTorch "
                        "path:\n%s", compiler, result.stderr[-2000:])
            return None
        os.replace(partial, target)
        return target
    log.warning("no private, writable cache folder for the CPU attention kernel (%s); using "
                "the PyTorch path", ", ".join(str(f) for f in _cache_dirs()))
    return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here (logged once)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (gcc or $CC) for the CPU attention kernel; using the "
                    "PyTorch path, slower at long contexts")
        return None
    path = _build(compiler)
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


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_rows: torch.Tensor, q_starts: torch.Tensor,
                 q_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> None:
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
