"""torch.ops.sluice.lora_add (csrc/lora.c), on every instruction-set variant this CPU runs
and on one and two threads: each row gets its own slot's B (A x) over its parts' blocks
only, as a float64 reference computes it, rounded once into bf16; base-model rows stay
bit for bit; bad arguments are errors, not reads out of bounds."""

from __future__ import annotations

import pytest
import torch


def case(rows: int, parts=(24, 8, 8), rank: int = 4, slots: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w, out, fan_in = len(parts) * rank, sum(parts), 40
    x = torch.randn(rows, fan_in, generator=gen).bfloat16()
    a = torch.randn(slots, w, fan_in, generator=gen).bfloat16()
    b = torch.zeros(slots, w, out)
    off = 0
    for j, size in enumerate(parts):  # block-diagonal, as LoRALinear stores it
        b[:, j * rank:(j + 1) * rank, off:off + size] = torch.randn(slots, rank, size,
                                                                    generator=gen)
        off += size
    y = torch.randn(rows, out, generator=gen).bfloat16()
    row_slots = torch.randint(-1, slots, (rows,), generator=gen, dtype=torch.int32)
    return x, a, b.bfloat16(), y, row_slots, parts, rank


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_lora_add_equals_a_float64_reference(ops, rows, threads):
    x, a, b, y, row_slots, parts, rank = case(rows)
    want = y.double().clone()
    for t, s in enumerate(row_slots.tolist()):
        if s >= 0:
            want[t] += b[s].double().T @ (a[s].double() @ x[t].double())
    got = y.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.lora_add(got, x, a, b, row_slots, parts, rank)
    finally:
        torch.set_num_threads(before)
    base = row_slots < 0
    assert torch.equal(got[base], y[base])
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=1e-2, atol=5e-2)


def test_lora_add_refuses_what_it_cannot_read(ops):
    x, a, b, y, row_slots, parts, rank = case(5)
    with pytest.raises(RuntimeError, match="names slot 3 of 3"):
        ops.lora_add(y, x, a, b, torch.full((5,), 3, dtype=torch.int32), parts, rank)
    with pytest.raises(RuntimeError, match="add up to out"):
        ops.lora_add(y, x, a, b, row_slots, (24, 8, 7), rank)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.lora_add(y.float(), x, a, b, row_slots, parts, rank)
    with pytest.raises(RuntimeError, match="parts x rank"):
        ops.lora_add(y, x, a, b, row_slots, parts, rank + 1)


def test_a_cpu_lora_context_takes_the_kernel():
    from sluice.engine.lora.layers import LoRAContext
    from sluice.engine.lora.punica import CpuLoRAOps

    assert isinstance(LoRAContext(2, 16, torch.device("cpu")).ops, CpuLoRAOps)
