"""dtype and device choice when building a model."""

from __future__ import annotations

import pytest
import torch

from servelm.models.factory import build_model, resolve_device, resolve_dtype
from servelm.models.loader import load_checkpoint
from servelm.testing.reference_decode import prompt_logits
from servelm.testing.tiny_model import write_tiny_checkpoint


def test_auto_dtype_is_fp32_on_cpu_and_bf16_on_accelerators():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="valid: auto, float32, bfloat16, float16"):
        resolve_dtype("int3", torch.device("cpu"))


def test_device_choice():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_tracks_fp32(tmp_path, dtype):
    checkpoint = load_checkpoint(write_tiny_checkpoint(tmp_path / "m", seed=2))
    fp32 = build_model(checkpoint.arch, checkpoint.weights, torch.float32)
    half = build_model(checkpoint.arch, checkpoint.weights, dtype)
    assert half.embed_tokens.weight.dtype == dtype
    assert half.layers[0].self_attn.rotary.inv_freq.dtype == torch.float32  # frequencies stay exact
    prompt = list(range(300, 340))
    reference, approx = prompt_logits(fp32, [prompt])[0], prompt_logits(half, [prompt])[0]
    assert approx.dtype == torch.float32  # logits are upcast for sampling
    # Same top token at most positions; half precision may flip near-ties.
    agreement = (reference.argmax(-1) == approx.argmax(-1)).float().mean().item()
    assert agreement >= 0.9
