"""FP8 block-scaled checkpoints (DeepSeek-V3's layout): the published dequantization bit for bit,
edge blocks included; the loader pairing codes with scales; the model equal to transformers on the
dequantized weights; the block-scaled Triton GEMM (interpreted here) against the dense product;
refusals of what cannot be loaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.models.arch import UnsupportedQuantizationError
from servelm.models.factory import build_model
from servelm.models.fp8_blocks import (
    FP8_DTYPE,
    FP8_QUANTIZED_LINEAR,
    SCALE_SUFFIX,
    Fp8BlockScheme,
    Fp8BlockWeight,
    quantize_fp8_blocks,
)
from servelm.models.hf_loader import load_hf_directory, read_hf_config
from servelm.models.layers import Linear
from servelm.models.linear_methods import Fp8BlockLinearMethod, choose_linear_method
from servelm.models.weights import CheckpointWeights, Storage, TensorInfo
from servelm.testing.engine_run import greedy_requests, run_requests
from servelm.testing.reference_decode import prompt_logits
from servelm.testing.tiny_model import write_fp8_checkpoint, write_tiny_checkpoint

BLOCK = (32, 32)  # small blocks, so the tiny models' 48- and 96-wide weights end in partial ones


def published_dequant(codes: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """DeepSeek-V3's `weight_dequant`, block by block as its kernel's programs run: float32(q) * s."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * block_n, (i + 1) * block_n), slice(j * block_k, (j + 1) * block_k)
            out[rows, cols] = codes[rows, cols].to(torch.float32) * scales[i, j]
    return out


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (7, 129), (128, 1)])
def test_dequantization_is_the_published_formula_bit_for_bit(shape) -> None:
    scheme = Fp8BlockScheme(128, 128)
    generator = torch.Generator().manual_seed(sum(shape))
    codes = (torch.randn(shape, generator=generator) * 100).to(FP8_DTYPE)
    scales = torch.rand(scheme.scale_shape(shape), generator=generator) * 1e-3 + 1e-5
    ours = Fp8BlockWeight(codes, scales, scheme).dequantize()
    reference = published_dequant(codes, scales, 128, 128)
    assert ours.dtype == torch.float32 and torch.equal(ours, reference)
    # Stored in the model's dtype, as the published conversion stores bfloat16: the same rounding.
    assert torch.equal(ours.to(torch.bfloat16), reference.to(torch.bfloat16))


def test_quantize_then_dequantize_stays_within_e4m3_precision() -> None:
    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    restored = quantize_fp8_blocks(weight, Fp8BlockScheme(128, 128)).dequantize()
    assert (restored - weight).abs().max() <= weight.abs().max() * 2**-3  # e4m3: 3 mantissa bits


@pytest.mark.parametrize(
    ("quantization", "match"),
    [
        ({"quant_method": "awq", "bits": 4}, "quantization 'awq' is not supported"),
        ({"quant_method": "gptq", "bits": 4}, "quantization 'gptq' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8 scales are not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "e5m2"),
    ],
)
def test_a_quantization_it_cannot_load_is_refused_at_config(tmp_path, quantization, match) -> None:
    path = write_tiny_checkpoint(tmp_path / "model", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(UnsupportedQuantizationError, match=match):
        read_hf_config(path)
    with pytest.raises(UnsupportedQuantizationError, match=match):
        load_hf_directory(path)


def test_scales_without_a_quantization_config_are_refused_not_loaded_as_values(tmp_path) -> None:
    path = write_fp8_checkpoint(write_tiny_checkpoint(tmp_path / "model", "llama"), tmp_path / "fp8", BLOCK)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="no quantization_config"):
        load_hf_directory(path)


def test_a_scale_of_the_wrong_shape_is_named_before_anything_is_read(tmp_path) -> None:
    path = write_fp8_checkpoint(write_tiny_checkpoint(tmp_path / "model", "llama"), tmp_path / "fp8", BLOCK)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight" + SCALE_SUFFIX
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"'{name}' has shape"):
        load_hf_directory(path)


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3"])
def fp8_checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """(transformers' model of the checkpoint dequantized by the published formula, the FP8
    checkpoint's directory), sharded with an index as published."""
    root = tmp_path_factory.mktemp(request.param)
    source = write_tiny_checkpoint(root / "model", request.param, seed=4, max_shard_size="2MB", num_hidden_layers=3)
    path = write_fp8_checkpoint(source, root / "fp8", BLOCK)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    quantized = [name for name in index if FP8_QUANTIZED_LINEAR.match(name)]
    assert quantized and all(name + SCALE_SUFFIX in index for name in quantized)
    # The reference reads float32 weights written back from the codes and scales: the source's
    # directory with each quantized tensor replaced, file by file.
    for file in sorted(path.glob("*.safetensors")):
        stored = load_file(str(file))
        restored = load_file(str(source / file.name))
        for name in [n for n in stored if n in quantized]:
            restored[name] = published_dequant(stored[name], stored[name + SCALE_SUFFIX], *BLOCK)
        save_file(restored, str(source / file.name), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(), path


def test_an_fp8_checkpoint_gives_the_dequantized_models_logits(fp8_checkpoint) -> None:
    reference, path = fp8_checkpoint
    arch, weights, _ = load_hf_directory(path)
    assert SCALE_SUFFIX not in "".join(weights)  # scales travel with their weights, not as tensors
    assert any(weights.info(name).storage is Storage.FP8_BLOCK for name in weights)
    ours = build_model(arch, weights, torch.float32, "cpu")
    ids = torch.randint(0, reference.config.vocab_size, (120,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(prompt_logits(ours, [ids.tolist()])[0], expected, rtol=1e-4,
                               atol=1e-4 * expected.abs().max().item())  # fmt: skip


def test_the_engine_serves_an_fp8_checkpoint_greedy_as_transformers(fp8_checkpoint) -> None:
    reference, path = fp8_checkpoint
    rng = random.Random(9)
    prompts = [[rng.randrange(reference.config.vocab_size) for _ in range(rng.randint(5, 90))] for _ in range(4)]
    expected = {}
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)  # fmt: skip
        expected[str(i)] = out[0, len(prompt) :].tolist()
    config = EngineConfig.from_flat(model=str(path), num_blocks=32, block_size=16, max_num_batched_tokens=64,
                                    max_step_ms=0)  # fmt: skip
    built = build_engine(config)
    try:
        run = run_requests(built.core, greedy_requests(prompts, [12] * len(prompts)), [0, 0, 1, 2])
    finally:
        built.core.close()
    assert run.tokens == expected


def _fp8_linear(parts: dict[str, Fp8BlockWeight], biases: dict[str, torch.Tensor], in_features: int) -> Linear:
    infos = [TensorInfo.of(weight) for weight in parts.values()]
    method = choose_linear_method(infos, torch.float32, torch.device("cuda"))  # what a CUDA model would get
    assert isinstance(method, Fp8BlockLinearMethod)
    out_features = sum(weight.shape[0] for weight in parts.values())
    layer = Linear(in_features, out_features, True, tuple(name.removesuffix(".weight") for name in parts), method)
    with torch.no_grad():
        layer.load(CheckpointWeights.from_tensors({**parts, **biases}))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 5, 40])
def test_the_block_scaled_gemm_is_the_dense_product_of_the_dequantized_weight(dtype, num_rows) -> None:
    """The Triton kernel (interpreted on CPU: tests/conftest.py) over fused parts whose last one and
    whose inputs end in partial blocks, against F.linear on the dequantized weight."""
    scheme = Fp8BlockScheme(64, 64)
    generator = torch.Generator().manual_seed(num_rows)
    sizes = (128, 64, 72)
    parts = {f"p{i}.weight": quantize_fp8_blocks(torch.randn(rows, 200, generator=generator), scheme)
             for i, rows in enumerate(sizes)}  # fmt: skip
    biases = {f"p{i}.bias": torch.randn(rows, generator=generator) for i, rows in enumerate(sizes)}
    layer = _fp8_linear(parts, biases, 200)
    x = torch.randn(num_rows, 200, generator=generator).to(dtype)
    weight = torch.cat([weight.dequantize() for weight in parts.values()]).to(dtype)
    expected = torch.nn.functional.linear(x.float(), weight.float(), torch.cat(list(biases.values())))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    actual = layer.to(dtype)(x) if dtype != torch.float32 else layer(x)
    torch.testing.assert_close(actual.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_fp8_layers_are_dense_where_the_gemm_does_not_run() -> None:
    """On CPU, and on CUDA when a fused part does not start on a scale row, the codes are dequantized."""
    info = TensorInfo((96, 64), Storage.FP8_BLOCK, (64, 64))
    assert not isinstance(choose_linear_method([info], torch.float32, torch.device("cpu")), Fp8BlockLinearMethod)
    assert not isinstance(
        choose_linear_method([info, info], torch.bfloat16, torch.device("cuda")), Fp8BlockLinearMethod
    )
    assert isinstance(choose_linear_method([info], torch.bfloat16, torch.device("cuda")), Fp8BlockLinearMethod)
