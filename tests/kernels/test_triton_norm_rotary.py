"""The Triton RMSNorm (+ residual add) and rotary kernels against the model's torch math, and the model
with them forced against the model without them.

Without a GPU the kernels run under Triton's interpreter: TRITON_INTERPRET=1 is set here, before
the kernels are first imported (fused_ops.triton_ops() imports them; triton reads the variable when
a kernel is defined). With a GPU the same tests run the compiled kernels on it.

Tolerances: float32 and float16 are bitwise where the math is elementwise (the residual sum, the
rotation) and within float32 rounding for the norm (only the order of its sum of squares differs).
bfloat16 gets one bf16 rounding step of slack: the interpreter (triton 3.6) casts float32 to
bfloat16 by truncation where the GPU and torch round to nearest even.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from servelm import envs
from servelm.models import fused_ops
from servelm.models.arch import RopeScaling
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.models.rotary import RotaryEmbedding, apply_rotary
from servelm.testing.reference_decode import greedy_decode, prompt_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SMOLLM2_THETA = 100000.0  # the default model's rope_theta
# One bf16 step (2^-7 relative) per rounding the interpreter truncates, a few of them in a row.
BF16 = {"rtol": 2**-5, "atol": 2**-5}


@pytest.fixture(scope="module")
def triton_ops() -> fused_ops.NormRotaryOps:
    return fused_ops.triton_ops()


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _assert_norm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, **BF16)
    elif want.dtype == torch.float16:  # one fp16 step of the normalised value, times |weight| <~ 4
        torch.testing.assert_close(got, want, rtol=2**-9, atol=2**-9)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 33])
def test_add_rms_norm_is_the_torch_math(triton_ops, dtype, num_tokens):
    hidden = 576  # not a power of two: the row is masked
    # Rows with a stride wider than the row (a slice of a bigger buffer), and an offset scale.
    x = _randn(num_tokens, hidden + 64, dtype=dtype, seed=1, scale=3.0)[:, :hidden]
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=2, scale=10.0)
    weight = _randn(hidden, dtype=dtype, seed=3)

    normed, total = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_total = fused_ops.torch_add_rms_norm(x, residual, weight, 1e-5)

    if dtype == torch.bfloat16:
        torch.testing.assert_close(total, want_total, **BF16)
    else:
        assert torch.equal(total, want_total)  # the sum, rounded once to the dtype
    _assert_norm_close(normed, want_normed)
    if dtype != torch.bfloat16:  # the norm of exactly the sum torch computed
        _assert_norm_close(triton_ops.rms_norm(want_total, weight, 1e-5), want_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 576), (7, 64), (3, 4096), (2, 100)])
def test_rms_norm_is_the_torch_math(triton_ops, dtype, num_tokens, hidden):
    x = _randn(num_tokens, hidden, dtype=dtype, seed=hidden, scale=0.01 if hidden == 100 else 5.0)
    weight = _randn(hidden, dtype=dtype, seed=hidden + 1)
    _assert_norm_close(triton_ops.rms_norm(x, weight, 1e-6), fused_ops.torch_rms_norm(x, weight, 1e-6))


def test_rms_norm_keeps_torch_type_promotion_for_a_float32_weight(triton_ops):
    x = _randn(4, 576, dtype=torch.bfloat16, seed=5)
    weight = _randn(576, dtype=torch.float32, seed=6)
    got = triton_ops.rms_norm(x, weight, 1e-5)
    want = fused_ops.torch_rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **BF16)


def test_norm_rejects_a_mismatched_residual(triton_ops):
    x = _randn(2, 64, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="residual"):
        triton_ops.add_rms_norm(x, x.half(), torch.ones(64, device=DEVICE), 1e-5)


ROPES = {
    "smollm2": (SMOLLM2_THETA, None),
    "llama3": (500000.0, RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize(("num_tokens", "max_position"), [(1, 131072), (19, 8192), (6, 1_000_000)])
def test_rotary_is_the_torch_math_in_place_on_the_qk_columns(triton_ops, dtype, rope, num_tokens, max_position):
    heads, kv_heads, head_dim = 9, 3, 64  # the default model's: 12 q|k heads, not a power of two
    theta, scaling = ROPES[rope]
    rotary = RotaryEmbedding(head_dim, theta, scaling).to(DEVICE)
    gen = torch.Generator().manual_seed(num_tokens)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(DEVICE)
    positions[0] = max_position - 1
    cos, sin = rotary.cos_sin(positions, dtype)
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7, scale=4.0)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    want = apply_rotary(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()

    got = triton_ops.rotate(qk, cos, sin)

    assert got.data_ptr() == qkv.data_ptr()  # in place, in the fused projection's buffer
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, **BF16)
    else:
        assert torch.equal(got, want)  # each product rounded as torch rounds it, then the sum


@pytest.mark.parametrize(("num_tokens", "num_heads", "head_dim"), [(0, 4, 64), (3, 70, 128), (2, 5, 32)])
def test_rotary_other_shapes(triton_ops, num_tokens, num_heads, head_dim):
    """No tokens; more heads than one program takes (70 heads of 128: two head groups); small heads."""
    rotary = RotaryEmbedding(head_dim, 10000.0, None).to(DEVICE)
    positions = torch.arange(num_tokens, device=DEVICE) * 1000
    cos, sin = rotary.cos_sin(positions, torch.float32)
    x = _randn(num_tokens, num_heads, head_dim, dtype=torch.float32, seed=head_dim)
    want = apply_rotary(x, cos, sin)
    assert torch.equal(triton_ops.rotate(x, cos, sin), want)


def test_rotary_rejects_angles_of_another_dtype(triton_ops):
    x = _randn(2, 4, 16, dtype=torch.bfloat16, seed=0)
    cos, sin = RotaryEmbedding(16, 10000.0, None).to(DEVICE).cos_sin(torch.arange(2, device=DEVICE), torch.float32)
    with pytest.raises(ValueError, match="cos is torch.float32"):
        triton_ops.rotate(x, cos, sin)


def test_kernels_compile_for_sm90_and_the_rotary_keeps_its_roundings():
    """The GPU compiler, on CPU (see triton_norm_rotary_compile.py): what the interpreter cannot show."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    script = Path(__file__).with_name("triton_norm_rotary_compile.py")
    result = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok   sm_90") == 9, result.stdout


def test_the_factory_gives_triton_on_cuda_and_the_compiled_row_ops_on_cpu(monkeypatch):
    cpu_set = fused_ops.select_ops(torch.device("cpu"))
    assert cpu_set is (fused_ops.cpu_ops() or fused_ops.TORCH_OPS)  # the row ops where the C kernels build
    assert fused_ops.select_ops(torch.device("meta")) is fused_ops.TORCH_OPS
    assert fused_ops.select_ops(torch.device("cuda")).name == "triton"  # triton imports here
    monkeypatch.setenv(envs.KERNELS, "torch")
    assert fused_ops.select_ops(torch.device("cuda")) is fused_ops.TORCH_OPS
    assert fused_ops.select_ops(torch.device("cpu")) is fused_ops.TORCH_OPS


PROMPTS = [[1, 15, 200, 7, 7, 99, 1023, 4, 18, 30, 2, 5, 6], [300, 12], [9]]


@pytest.fixture(scope="module")
def unfused_and_fused(tiny_dir):
    checkpoint = load_checkpoint(tiny_dir)
    unfused = build_model(checkpoint.arch, checkpoint.weights, torch.float32, DEVICE)
    fused = build_model(checkpoint.arch, checkpoint.weights, torch.float32, DEVICE)
    unfused.norm_rotary_ops = fused_ops.TORCH_OPS
    fused.norm_rotary_ops = fused_ops.triton_ops()
    return unfused, fused


def test_fused_model_prompt_logits_match_the_unfused_model(unfused_and_fused):
    unfused, fused = unfused_and_fused
    for want, got in zip(prompt_logits(unfused, PROMPTS), prompt_logits(fused, PROMPTS), strict=True):
        assert got.shape == want.shape
        relative = ((got - want).abs().max() / want.abs().max()).item()
        assert relative < 1e-5, relative


def test_fused_model_greedy_tokens_are_the_unfused_models(unfused_and_fused):
    unfused, fused = unfused_and_fused
    for prompt in PROMPTS[:2]:
        assert greedy_decode(fused, prompt, 6) == greedy_decode(unfused, prompt, 6)
