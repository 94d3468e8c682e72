"""oneDNN's float32 GEMM (kernels/onednn_gemm.py): one reordering of a weight serves every row count
within float32 rounding of the exact product, keeps no reference to the weight, refuses what it
cannot take, ignores a caller's default device, and its whole read (the keep-warm pass) reads it."""

from __future__ import annotations

import copy

import pytest
import torch

from servelm.kernels import onednn_gemm
from servelm.kernels.arguments import KernelArgumentError
from servelm.models.gemm_precision import OneDnnFloat32Gemm

needs_onednn = pytest.mark.skipif(onednn_gemm.load() is None, reason="PyTorch here carries no oneDNN linear ops")


def _within_float32_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|got - exact| within float32's summation error bound k * eps * (|x| @ |w|^T)."""
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2**-24 * (x.abs().double() @ w.abs().double().T)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert torch.all((got.double() - exact).abs() <= bound + 1e-30)


@needs_onednn
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (37, 19)])
def test_one_reordering_serves_every_row_count(n: int, k: int):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    kernel = onednn_gemm.load()
    packed = kernel.pack(w)
    for m in (1, 7, 63, 178, 513, 2000):
        x = torch.randn(m, k, generator=gen)
        _within_float32_rounding(kernel.matmul(x, packed), x, w)
    assert kernel.matmul(torch.empty(0, k), packed).shape == (0, n)
    assert onednn_gemm.num_bytes(packed) >= n * k * 4


@needs_onednn
def test_reordering_keeps_no_reference_to_the_weight():
    w, x = torch.randn(64, 32), torch.randn(20, 32)
    kernel = onednn_gemm.load()
    packed = kernel.pack(w)
    expected = kernel.matmul(x, packed)
    w.zero_()
    assert torch.equal(kernel.matmul(x, packed), expected)
    onednn_gemm.read_all(packed)  # the keep-warm read: it reads, it does not write
    assert torch.equal(kernel.matmul(x, packed), expected)


@needs_onednn
def test_bad_arguments_are_refused():
    kernel = onednn_gemm.load()
    packed = kernel.pack(torch.randn(16, 32))
    with pytest.raises(KernelArgumentError, match="expected 32 columns"):
        kernel.matmul(torch.randn(4, 31), packed)
    with pytest.raises(KernelArgumentError, match="x: expected dtype torch.float32"):
        kernel.matmul(torch.randn(4, 32, dtype=torch.float64), packed)
    with pytest.raises(KernelArgumentError, match="expected 32 columns against a weight reordered by pack"):
        kernel.matmul(torch.randn(4, 32), torch.randn(16, 32))  # a plain tensor, not reordered
    with pytest.raises(KernelArgumentError, match="an empty matrix"):
        kernel.pack(torch.empty(0, 16))


@needs_onednn
def test_reordering_ignores_a_callers_default_device():
    kernel = onednn_gemm.load()
    w, x = torch.randn(24, 16), torch.randn(12, 16)
    with torch.device("meta"):  # the model factory builds inside such a context
        got = kernel.matmul(x, kernel.pack(w))
    assert got.device.type == "cpu"
    _within_float32_rounding(got, x, w)


@needs_onednn
def test_a_copied_gemm_reorders_its_own():
    gemm = OneDnnFloat32Gemm(onednn_gemm.load())
    w, x = torch.randn(40, 48), torch.randn(12, 48)
    first = gemm(x, w)
    twin = copy.deepcopy(gemm)  # a oneDNN tensor has no deep copy: the copy starts empty and reorders
    assert twin._derived is None
    assert torch.equal(twin(x, w), first)
