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


def test_shapes_that_do_not_fit_are_refused(kernels: cpu.CpuKernels) -> None:
    a, bt = torch.zeros(2, 8, 16), torch.zeros(2, 8, 10)
    slots, widths = torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(KernelArgumentError, match="do not fit"):
        kernels.lora_bgmv_(torch.zeros(3, 11), torch.zeros(3, 16), a, bt, slots, widths)
    with pytest.raises(KernelArgumentError, match="int64"):
        kernels.lora_bgmv_(torch.zeros(3, 10), torch.zeros(3, 16), a, bt, slots.int(), widths)
