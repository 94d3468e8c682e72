"""MKL's packed float32 GEMM (kernels/mkl_gemm.py): one packing of a weight serves every row count
within float32 rounding of the exact product, bad arguments (and copied panels) are refused before
a pointer reaches MKL, SERVELM_KERNELS=torch turns it off. A CPU float32 model's decoder layers
take a packed GEMM for their many-row matmuls (and only there), following their weight's changes:
oneDNN's where PyTorch carries it (kernels/onednn_gemm.py), else MKL's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from servelm import envs
from servelm.kernels import mkl_gemm, onednn_gemm
from servelm.kernels.arguments import KernelArgumentError
from servelm.models.factory import build_model
from servelm.models.gemm_precision import OneDnnFloat32Gemm, PackedFloat32Gemm, many_row_gemm
from servelm.models.linear_methods import DENSE, MAX_BLOCK_ROWS, DenseLinearMethod, dense_method
from servelm.models.llama import Linear
from servelm.models.loader import load_checkpoint
from servelm.testing.tiny_model import write_tiny_checkpoint

needs_mkl = pytest.mark.skipif(mkl_gemm.load() is None, reason="PyTorch here carries no MKL")
CPU = torch.device("cpu")
# What a float32 model's many-row matmuls take here: oneDNN's where PyTorch carries it, else MKL's.
PACKED = OneDnnFloat32Gemm if onednn_gemm.load() is not None else PackedFloat32Gemm


def _within_float32_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|got - exact| within float32's summation error bound k * eps * (|x| @ |w|^T)."""
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2**-24 * (x.abs().double() @ w.abs().double().T)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert torch.all((got.double() - exact).abs() <= bound + 1e-30)


@needs_mkl
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (37, 19)])
def test_one_packing_serves_every_row_count(n: int, k: int):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    kernel = mkl_gemm.load()
    packed = kernel.pack(w)
    for m in (1, 7, 63, 178, 513, 2000):  # under, at and over the packing's row hint
        x = torch.randn(m, k, generator=gen)
        _within_float32_rounding(kernel.matmul(x, packed), x, w)
    assert kernel.matmul(torch.empty(0, k), packed).shape == (0, n)


@needs_mkl
def test_packing_keeps_no_reference_to_the_weight():
    w = torch.randn(64, 32)
    x = torch.randn(20, 32)
    kernel = mkl_gemm.load()
    packed = kernel.pack(w)
    expected = kernel.matmul(x, packed)
    w.zero_()
    assert torch.equal(kernel.matmul(x, packed), expected)


@needs_mkl
def test_bad_arguments_are_refused():
    kernel = mkl_gemm.load()
    packed = kernel.pack(torch.randn(16, 32))
    with pytest.raises(KernelArgumentError, match="x: expected 32 columns"):
        kernel.matmul(torch.randn(4, 31), packed)
    with pytest.raises(KernelArgumentError, match="x: expected dtype torch.float32"):
        kernel.matmul(torch.randn(4, 32, dtype=torch.float64), packed)
    with pytest.raises(KernelArgumentError, match="x: expected a contiguous tensor"):
        kernel.matmul(torch.randn(32, 4).T, packed)
    with pytest.raises(KernelArgumentError, match="weight: expected a contiguous tensor"):
        kernel.pack(torch.randn(32, 16).T)
    with pytest.raises(KernelArgumentError, match="weight rows: expected at least 1"):
        kernel.pack(torch.empty(0, 16))
    with pytest.raises(KernelArgumentError, match="copied or moved after packing"):
        kernel.matmul(torch.randn(4, 32), copy.deepcopy(packed))  # the panels point into their own buffer


@needs_mkl
def test_packing_ignores_a_callers_default_device():
    kernel = mkl_gemm.load()
    w, x = torch.randn(24, 16), torch.randn(12, 16)
    with torch.device("meta"):  # the model factory builds inside such a context
        packed = kernel.pack(w)
        got = kernel.matmul(x, packed)
    assert got.device.type == "cpu"
    _within_float32_rounding(got, x, w)


@needs_mkl
def test_torch_switch_turns_it_off(kernel_env):
    assert isinstance(many_row_gemm("float32", torch.float32, CPU), PACKED)
    kernel_env(envs.KERNELS, "torch")
    assert mkl_gemm.load() is None and onednn_gemm.load() is None
    assert many_row_gemm("float32", torch.float32, CPU) is None
    assert dense_method(torch.float32, CPU) is DENSE


@needs_mkl
def test_only_cpu_float32_models_pack():
    assert many_row_gemm("float32", torch.bfloat16, CPU) is None
    assert many_row_gemm("float32", torch.float32, torch.device("meta")) is None
    assert dense_method(torch.float32, torch.device("cuda")) is DENSE


@needs_mkl
def test_a_dense_layer_packs_its_many_row_matmuls_and_repacks_after_a_reload():
    method = dense_method(torch.float32, CPU)
    assert isinstance(method, DenseLinearMethod) and isinstance(method.gemm, PACKED)
    linear = Linear(48, 40, True, ("unused",), method)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 48, generator=gen))
        linear.bias.copy_(torch.randn(40, generator=gen))
    few, many = torch.randn(MAX_BLOCK_ROWS, 48, generator=gen), torch.randn(MAX_BLOCK_ROWS + 1, 48, generator=gen)
    assert torch.equal(linear(few), F.linear(few, linear.weight, linear.bias))  # few rows: F.linear itself
    _within_float32_rounding(linear(many) - linear.bias, many, linear.weight.detach())
    with torch.no_grad():  # new rows through the method (a weight reload): the panels are made again
        method.load_rows(linear, torch.ones(40, 48), 0)
    torch.testing.assert_close(linear(many), F.linear(many, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)
    with torch.no_grad():  # written in place outside the method: made again too
        linear.weight.mul_(-3)
    torch.testing.assert_close(linear(many), F.linear(many, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)
    twin = copy.deepcopy(linear)  # a copied model derives its own panels
    torch.testing.assert_close(twin(many), F.linear(many, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)


@needs_mkl
def test_a_weight_made_under_inference_mode_packs_once():
    gemm = many_row_gemm("float32", torch.float32, CPU)
    with torch.inference_mode():
        w, x = torch.randn(20, 16), torch.randn(12, 16)
    first = gemm(x, w)
    panels = gemm._derived
    assert torch.equal(gemm(x, w), first) and gemm._derived is panels
    _within_float32_rounding(first, x, w)


@needs_mkl
def test_an_empty_weight_takes_f_linear():
    gemm = many_row_gemm("float32", torch.float32, CPU)
    x = torch.randn(12, 0)
    assert torch.equal(gemm(x, torch.empty(5, 0)), torch.zeros(12, 5))
    assert gemm(torch.randn(12, 4), torch.empty(0, 4)).shape == (12, 0)


@needs_mkl
def test_the_lm_head_is_not_packed(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", arch="llama", seed=1)
    checkpoint = load_checkpoint(hf_dir)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    assert model.lm_head.method is DENSE
    assert isinstance(model.layers[0].mlp.down_proj.method.gemm, PACKED)
