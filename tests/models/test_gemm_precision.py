"""--gemm-precision: a CPU float32 model's many-row matmuls in bfloat16 stay within their analytic
error of float32, prefill's attention computes in bfloat16 too, few-row matmuls (decode) and the
LM head stay float32 bit for bit, the
derived weights follow a reload, and the whole default model keeps float32's argmax nearly
everywhere (benchmarks/gemm_precision.py measures how nearly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.config import EngineConfig, ModelConfig
from servelm.default_model import default_model_path
from servelm.models.factory import build_model
from servelm.models.gemm_precision import Bfloat16Gemm, OneDnnFloat32Gemm, PackedFloat32Gemm, check_gemm_precision
from servelm.models.linear_methods import MAX_BLOCK_ROWS, BlockLinearMethod, DenseLinearMethod
from servelm.models.loader import load_checkpoint
from servelm.testing.reference_decode import prompt_logits
from servelm.worker.model_runner import attention_backend_of


def _inputs(rows: int, cols: int, out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 4  # rows of varied scale
    w = torch.randn(out, cols, generator=gen) * 0.05
    return x, w


def test_bfloat16_gemm_is_within_its_rounding_bound():
    x, w = _inputs(40, 256, 48, seed=3)
    got = Bfloat16Gemm()(x, w)
    exact = x.double() @ w.double().T
    # Rounding to bf16 moves each operand by at most 2^-8 of itself (accumulation is float32).
    bound = 2 * 2**-8 * (x.abs().double() @ w.abs().double().T)
    assert torch.all((got.double() - exact).abs() <= bound * 1.01 + 1e-5)
    assert got.dtype == torch.float32


def test_derived_weight_follows_the_weight():
    x, w = _inputs(16, 64, 8, seed=4)
    g = Bfloat16Gemm()
    first = g(x, w)
    derived = g._derived
    assert torch.equal(g(x, w), first) and g._derived is derived  # the same weight: derived once
    w.mul_(2)  # written in place (its version moves): derived again
    assert torch.allclose(g(x, w), first * 2, rtol=0.02, atol=1e-3)
    assert torch.allclose(g(x, w * 2), first * 4, rtol=0.02, atol=1e-3)  # another tensor
    doubled = g._derived
    g.reset()
    assert torch.allclose(g(x, w), first * 2, rtol=0.02, atol=1e-3) and g._derived is not doubled


def test_gemm_precision_is_for_cpu_float32_models_only():
    check_gemm_precision("bfloat16", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="float32 models on CPU"):
        check_gemm_precision("bfloat16", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="float32 models on CPU"):
        check_gemm_precision("bfloat16", torch.float32, torch.device("meta"))
    with pytest.raises(ValueError, match="gemm_precision must be one of"):
        ModelConfig(gemm_precision="int8")
    assert EngineConfig.from_flat(gemm_precision="bfloat16").model.gemm_precision == "bfloat16"


@pytest.fixture(scope="module")
def default_models():
    checkpoint = load_checkpoint(default_model_path())
    models = {
        p: build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu", gemm_precision=p)
        for p in ("float32", "bfloat16")
    }
    return checkpoint, models


def test_only_decoder_many_row_matmuls_change(default_models):
    precision = "bfloat16"
    _, models = default_models
    reference, narrow = models["float32"], models[precision]
    head_gemm = getattr(narrow.lm_head.method, "gemm", None)
    assert head_gemm is None or isinstance(head_gemm, (OneDnnFloat32Gemm, PackedFloat32Gemm))  # float32 logits
    # Prefill's attention computes in bfloat16 too; the reference's in float32.
    assert attention_backend_of(narrow).prefill_compute_dtype == torch.bfloat16
    assert attention_backend_of(reference).prefill_compute_dtype is None
    layer, reference_layer = narrow.layers[0].mlp.gate_up_proj, reference.layers[0].mlp.gate_up_proj
    assert isinstance(layer.method, DenseLinearMethod) and layer.method.gemm is not None
    assert isinstance(layer.method, BlockLinearMethod)  # the default model's layers keep their blocks
    with torch.inference_mode():
        few = torch.randn(MAX_BLOCK_ROWS, layer.in_features)
        assert torch.equal(layer(few), reference_layer(few))  # decode: the same block kernel
        many = torch.randn(MAX_BLOCK_ROWS + 1, layer.in_features)
        assert not torch.equal(layer(many), reference_layer(many))
        exact = F.linear(many, reference_layer.weight)
        relative = (layer(many) - exact).norm() / exact.norm()  # ~0.3% on these inputs
        assert 0 < relative < 0.01, f"{precision}: relative error {relative:.4f}"


def test_default_model_keeps_float32s_argmax(default_models):
    precision = "bfloat16"
    checkpoint, models = default_models
    text = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg"
    ids = list(checkpoint.tokenizer.encode(text * 6))
    reference = prompt_logits(models["float32"], [ids])[0]
    logits = prompt_logits(models[precision], [ids])[0]
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    error = (logits - reference).abs()
    assert agreement >= 0.9, f"{precision}: argmax agrees at {agreement:.1%} of {len(ids)} positions"
    assert error.mean() < 0.5, f"{precision}: mean |logit error| {error.mean():.3f}"
    assert error.max() > 0  # the narrower GEMM was taken
