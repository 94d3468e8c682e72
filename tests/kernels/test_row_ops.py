"""The compiled CPU row ops (csrc/row_ops.c, models/fused_ops.cpu_ops) against torch's float32 ops and a
float64 reference: rotary bitwise apply_rotary's, RMSNorm (alone and after the residual add) and
SiLU(gate) * up within a few float32 roundings, over row counts that split across threads and widths
with SIMD tails; SiLU's exp over the whole float range (overflow to inf and underflow to 0 included);
other dtypes and layouts fall back to the torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.kernels import build, cpu
from servelm.models.fused_ops import TORCH_OPS, NormRotaryOps, cpu_ops, select_ops
from servelm.models.rotary import apply_rotary

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler: the kernels cannot be built here")
ROWS = (1, 7, 8, 33, 130)  # one thread, a tail task, several tasks
WIDTHS = (8, 36, 64, 576)  # 36: a SIMD tail


# The builds this CPU can run: plain C (libm's expf, scalar loops), AVX2 + FMA, and this machine's own.
VARIANTS = {"plain C": frozenset(), "AVX2 + FMA": frozenset({"avx2", "fma"}), "this CPU": None}


@pytest.fixture(scope="module", params=list(VARIANTS))
def ops(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> NormRotaryOps:
    """The row ops of one build, as the CPU set calls them."""
    features = VARIANTS[request.param]
    if features is None:
        found = cpu_ops()
        assert found is not None
        return found
    if not features <= build.cpu_features():
        pytest.skip(f"this CPU lacks {sorted(features - build.cpu_features())}")
    kernels = cpu.CpuKernels(build.build(tmp_path_factory.mktemp("kernels"), features=features))
    return NormRotaryOps(request.param, lambda x, w, eps: kernels.rms_norm(x, w, eps)[0],
                         lambda x, r, w, eps: kernels.rms_norm(x, w, eps, r), kernels.rotate_, kernels.silu_mul)  # fmt: skip


def _ulps(got: torch.Tensor, want64: torch.Tensor) -> torch.Tensor:
    """|got - want| in float32 units in the last place of want (its magnitude, floored at the smallest normal)."""
    spacing = want64.abs().clamp_min(torch.finfo(torch.float32).tiny) * 2.0**-23
    return (got.double() - want64).abs() / spacing


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_alone_and_after_the_residual_add(ops: NormRotaryOps, rows: int):
    gen = torch.Generator().manual_seed(rows)
    for width in WIDTHS:
        x, residual = torch.randn(rows, width, generator=gen) * 3, torch.randn(rows, width, generator=gen)
        weight = torch.randn(width, generator=gen)
        got = ops.rms_norm(x, weight, 1e-5)
        torch.testing.assert_close(got, F.rms_norm(x, (width,), weight, 1e-5), rtol=2e-6, atol=1e-6)
        normed, total = ops.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(total, x + residual)  # the sum itself is exact as torch's
        torch.testing.assert_close(normed, F.rms_norm(x + residual, (width,), weight, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_is_bitwise_apply_rotary_on_a_qkv_column_view(ops: NormRotaryOps, rows: int):
    gen = torch.Generator().manual_seed(100 + rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(rows, 1, dim // 2, generator=gen) * 50
    cos, sin = angles.cos(), angles.sin()
    view = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)  # rows strided by the v columns
    want = apply_rotary(view, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    got = ops.rotate(view, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # the v columns untouched


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_within_float32_rounding(ops: NormRotaryOps, rows: int):
    gen = torch.Generator().manual_seed(200 + rows)
    for width in WIDTHS:
        gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
        got = ops.silu_mul(gate_up)
        gate, up = gate_up.double().chunk(2, dim=-1)
        want = gate * torch.sigmoid(gate) * up
        assert _ulps(got, want).max() <= 8  # exp within 2 ulp, then a divide and a multiply


def test_silu_exp_over_the_whole_float_range(ops: NormRotaryOps):
    """Inputs from -1e30 to 1e30, the exp's clamps included: silu(x) ~ x for large x, -0 / tiny for very
    negative x (e^-x overflows to inf), and no NaN anywhere."""
    gate = torch.cat([torch.linspace(-100, 100, 4001), torch.tensor([-1e30, -3e38, -88.5, -87.0, 87.0, 88.5, 1e30])])
    gate_up = torch.stack([gate, torch.ones_like(gate)]).reshape(1, -1)  # gate | up = 1
    got = ops.silu_mul(gate_up)[0]
    want = gate.double() * torch.sigmoid(gate.double())
    assert not got.isnan().any()
    normal = want.abs() > torch.finfo(torch.float32).tiny * 2**10  # away from where both underflow
    assert _ulps(got[normal], want[normal]).max() <= 8
    assert (got[~normal].abs() <= 1e-30).all()


def test_other_dtypes_and_layouts_take_the_torch_ops():
    ops = cpu_ops()
    assert ops is not None
    x = torch.randn(4, 64).bfloat16()
    weight = torch.randn(64).bfloat16()
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), TORCH_OPS.rms_norm(x, weight, 1e-6))
    strided = torch.randn(64, 4).t()  # not contiguous
    assert torch.equal(ops.silu_mul(strided), TORCH_OPS.silu_mul(strided))
    assert select_ops(torch.device("cpu")) is ops


def test_switched_off_by_servelm_kernels_torch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SERVELM_KERNELS", "torch")
    assert select_ops(torch.device("cpu")) is TORCH_OPS
