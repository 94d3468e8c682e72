"""Int8 codes for block-quantised float32 weights: found exactly, and the small-batch kernel agrees
with the float32 matmul (the reference path) for single rows, small batches and whole models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from servelm.kernels import cpu as cpu_kernels
from servelm.models.arch import ModelArchConfig
from servelm.models.compact_weights import MAX_ROWS, find_codes
from servelm.models.factory import build_model
from servelm.models.llama import Linear
from servelm.testing.reference_decode import greedy_decode, prompt_logits

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the kernel cannot be built here")


def quantise_q4_1(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's reference Q4_1 round trip: per 32 inputs d = (max - min) / 15, m = min, both fp16."""
    blocks = w.reshape(w.shape[0], -1, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = torch.where(d == 0, torch.zeros_like(blocks), ((blocks - m) / torch.where(d == 0, 1, d)).round().clamp(0, 15))
    return ((d * q) + m).reshape(w.shape)


def quantise_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Q8_0: per 32 inputs d = amax / 127 (fp16), w = d * round(w / d)."""
    blocks = w.reshape(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    return (d * (blocks / d).round().clamp(-127, 127)).reshape(w.shape)


@pytest.mark.parametrize("quantise", [quantise_q4_1, quantise_q8_0])
def test_codes_rebuild_the_weight_bit_for_bit(quantise):
    w = quantise(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)))
    w[3, :32] = 0.25 if quantise is quantise_q4_1 else 0.0  # a constant block: d = 0
    compact = find_codes(w)
    assert compact is not None
    assert torch.equal(compact.dequantize(), w)
    assert (compact.mins is None) == (quantise is quantise_q8_0)


def test_ordinary_weights_get_no_codes():
    assert find_codes(torch.randn(64, 64)) is None
    assert find_codes(quantise_q4_1(torch.randn(64, 64)).bfloat16().float() + 1e-3) is None
    assert find_codes(torch.randn(8, 40)) is None  # inputs not a multiple of 32


@needs_kernel
@pytest.mark.parametrize("quantise", [quantise_q4_1, quantise_q8_0])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS])
def test_kernel_matches_float32_matmul(quantise, rows):
    gen = torch.Generator().manual_seed(rows)
    linear = Linear(320, 70, bias=True)
    with torch.no_grad():
        linear.weight.copy_(quantise(torch.randn(70, 320, generator=gen)))
        linear.bias.copy_(torch.randn(70, generator=gen))
    linear.compact = find_codes(linear.weight)
    assert linear.compact is not None
    x = torch.randn(rows, 320, generator=gen)
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    big = torch.randn(MAX_ROWS + 1, 320, generator=gen)  # above MAX_ROWS: the float32 path itself
    assert torch.equal(linear(big), F.linear(big, linear.weight, linear.bias))


@pytest.fixture(scope="module")
def quantised_llama():
    torch.manual_seed(0)
    hf = HFLlama(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    ))
    state = {}
    for name, tensor in hf.state_dict().items():
        if tensor.dim() == 2:  # every matrix block-quantised like a GGUF file's; the embedding as Q8_0
            tensor = (quantise_q8_0 if "embed" in name else quantise_q4_1)(tensor.float() * 3)
        state[name] = tensor
    config = hf.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    return ModelArchConfig.from_hf_config(config), state


@needs_kernel
def test_model_with_codes_matches_model_without(quantised_llama):
    arch, state = quantised_llama
    fast = build_model(arch, state, torch.float32, "cpu")
    reference = build_model(arch, state, torch.float32, "cpu", compact_weights=False)
    linears = [m for m in fast.modules() if isinstance(m, Linear)]
    assert all(m.compact is not None for m in linears), "every projection and the tied head get codes"
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    assert greedy_decode(fast, prompt, 24) == greedy_decode(reference, prompt, 24)
    short = [prompt[:3], prompt[:1]]  # few rows: the prompt forward itself takes the kernel
    for got, want in zip(prompt_logits(fast, short), prompt_logits(reference, short)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
