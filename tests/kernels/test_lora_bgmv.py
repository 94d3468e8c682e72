"""The compiled batched-LoRA kernel (csrc/lora.c) against a float64 reference, in the plain-C and the
AVX2 builds: each row adds its own slot's delta over the columns its adapter uses (a base-model row
nothing), whatever the rows' order or count; shapes that do not fit are refused."""

from __future__ import annotations

import pytest
import torch

from servelm.kernels import cpu
from servelm.kernels.arguments import KernelArgumentError

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler: the kernels cannot be built here")


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_each_row_adds_its_own_adapters_delta(kernels: cpu.CpuKernels, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    slots, width, in_features, out_features = 4, 24, 70, 45  # 70 and 45: SIMD tails
    a = torch.randn(slots, width, in_features, generator=generator)
    bt = torch.randn(slots, width, out_features, generator=generator)
    widths = torch.tensor([24, 8, 0, 16], dtype=torch.int64)  # slot 2 holds nothing
    row_slots = torch.randint(-1, slots, (rows,), generator=generator, dtype=torch.int64)
    x = torch.randn(rows, in_features, generator=generator)
    out = torch.randn(rows, out_features, generator=generator)
    want = out.double().clone()
    for t, s in enumerate(row_slots.tolist()):
        if s >= 0:
            w = int(widths[s])
            want[t] += (a[s, :w].double() @ x[t].double()) @ bt[s, :w].double()
    kernels.lora_bgmv_(out, x, a, bt, row_slots, widths)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    base_rows = row_slots < 0
    assert torch.equal(out[base_rows].double(), want[base_rows])  # untouched, bit for bit


@pytest.mark.parametrize("rows", [4, 8, 11])
def test_runs_of_one_adapters_rows_equal_each_row_alone_bit_for_bit(kernels: cpu.CpuKernels, rows: int) -> None:
    """Decode rows of one adapter are taken four at a time (sharing the loads of its weights): each
    row's value is still exactly what it gets alone, whatever run it falls in (an odd width and
    SIMD tails in both dimensions; a base-model row breaking a run)."""
    generator = torch.Generator().manual_seed(100 + rows)
    slots, width, in_features, out_features = 2, 17, 70, 45
    a = torch.randn(slots, width, in_features, generator=generator)
    bt = torch.randn(slots, width, out_features, generator=generator)
    widths = torch.tensor([16, 17], dtype=torch.int64)
    row_slots = torch.ones(rows, dtype=torch.int64)
    if rows > 8:
        row_slots[5] = -1
    x = torch.randn(rows, in_features, generator=generator)
    out = torch.randn(rows, out_features, generator=generator)
    before, alone = out.clone(), out.clone()
    for t in range(rows):
        kernels.lora_bgmv_(alone[t : t + 1], x[t : t + 1].contiguous(), a, bt, row_slots[t : t + 1].contiguous(), widths)
    kernels.lora_bgmv_(out, x, a, bt, row_slots, widths)
    assert torch.equal(out, alone)
    delta = (x.double() @ a[1].double().T) @ bt[1].double()
    want = before.double() + delta * (row_slots >= 0).double().unsqueeze(1)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


def test_shapes_that_do_not_fit_are_refused(kernels: cpu.CpuKernels) -> None:
    a, bt = torch.zeros(2, 8, 16), torch.zeros(2, 8, 10)
    slots, widths = torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(KernelArgumentError, match="do not fit"):
        kernels.lora_bgmv_(torch.zeros(3, 11), torch.zeros(3, 16), a, bt, slots, widths)
    with pytest.raises(KernelArgumentError, match="int64"):
        kernels.lora_bgmv_(torch.zeros(3, 10), torch.zeros(3, 16), a, bt, slots.int(), widths)
