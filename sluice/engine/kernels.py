"""The engine's CPU kernels (csrc/), built into `sluice.engine._C` when the package is
installed (setup.py), as torch ops: `torch.ops.sluice.rms_norm`, `rotary`, `paged_attention`,
`lora_add`.

`ops()` imports the library once. The best instruction-set variant the CPU runs is used, or
the one `SLUICE_CPU_ISA` names (`portable`, `avx2`, `avx512`, `avx512bf16` on x86-64; an
error when this CPU cannot run it). An install without the library (torch was missing at
build time) gets None, logged once, and the engine keeps its PyTorch paths. Fake kernels
give torch.compile the ops' output shapes.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)
ISA_ENV = "SLUICE_CPU_ISA"


@functools.cache
def ops() -> torch._ops._OpNamespace | None:
    try:
        import sluice.engine._C  # noqa: F401 -- registers torch.ops.sluice.*
    except ImportError as err:
        log.warning("the CPU kernels are not installed (%s): PyTorch paths only. Install "
                    "with torch present: pip install --no-build-isolation", err)
        return None
    if forced := os.environ.get(ISA_ENV):
        torch.ops.sluice.select_cpu_isa(forced)
    _register_fakes()
    log.info("CPU kernels: %s (this CPU runs %s)", torch.ops.sluice.cpu_isa(),
             ", ".join(torch.ops.sluice.cpu_isas()))
    return torch.ops.sluice


def _register_fakes() -> None:
    @torch.library.register_fake("sluice::rms_norm")
    def _rms_norm(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("sluice::rotary")
    def _rotary(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("sluice::lora_add")
    def _lora_add(y, x, a, b, row_slots, part_sizes, rank):
        return None

    @torch.library.register_fake("sluice::paged_attention")
    def _paged_attention(q, out, key_cache, value_cache, block_tables, seq_rows, q_starts,
                         q_lens, seq_lens, scale):
        return None
