"""torch.ops.sluice with each instruction-set variant this CPU runs selected in turn (the
`ops` fixture of conftest.py), so every variant's kernels meet the same reference."""

from __future__ import annotations

from collections.abc import Iterator

from sluice.engine import kernels

OPS = kernels.ops()
# No kernels installed is a failure, not a skip: `make install` builds them.
ISAS = list(OPS.cpu_isas()) if OPS is not None else ["not-installed"]


def selected(isa: str) -> Iterator:
    assert OPS is not None, "sluice.engine._C is built by `make install` (setup.py)"
    best = OPS.cpu_isa()
    OPS.select_cpu_isa(isa)
    try:
        yield OPS
    finally:
        OPS.select_cpu_isa(best)
