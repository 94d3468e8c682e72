"""Linear methods: GGUF Q4_1 / Q8_0 tensors read as int8 codes rebuild gguf's float32 weights bit for bit,
the int8 method's small-batch kernel agrees with the float32 matmul (the dense path), fused layers mixing
storage types are exact, and a whole model with int8 layers decodes like the all-dense one."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from servelm.default_model import default_model_path
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.gguf_loader import (
    INT8_BLOCK_TYPES,
    gguf_hf_config,
    gguf_to_hf_name,
    int8_block_weight,
    load_gguf_weights,
    open_gguf,
    unpermute_rope_rows,
)
from servelm.models.int8_blocks import Int8BlockWeight
from servelm.models.linear_methods import (
    DENSE,
    MAX_INT8_ROWS,
    DenseLinearMethod,
    Int8BlockLinearMethod,
    choose_linear_method,
    small_batch_kernel,
)
from servelm.models.llama import Linear
from servelm.models.weights import Storage, TensorInfo
from servelm.testing.reference_decode import greedy_decode, prompt_logits
from servelm.testing.tiny_model import write_tiny_checkpoint, write_tiny_gguf

needs_kernel = pytest.mark.skipif(small_batch_kernel() is None, reason="no C compiler: the kernel cannot be built here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _gguf_tensors(tmp_path: Path, matrices: dict[str, tuple[np.ndarray, Q]]) -> dict[str, gguf.ReaderTensor]:
    """Write matrices [N, K] as GGUF tensors of the given types; read them back through our reader."""
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch="llama")
    for name, (values, qtype) in matrices.items():
        data = quantize(values, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in open_gguf(tmp_path / "m.gguf").tensors}


def _matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    values[1, :32] = 0.25  # a constant block: d = 0 for Q4_1
    values[2, 32:64] = 0.0  # an all-zero block: d = 0 for Q8_0, -0.0 products
    values[3, :32] *= -1e-3  # tiny values: subnormal-ish half scales
    return values


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_codes_from_block_bytes_rebuild_gguf_dequantize_bit_for_bit(tmp_path: Path, qtype: Q):
    tensor = _gguf_tensors(tmp_path, {"w": (_matrix(48, 96, 0), qtype)})["w"]
    reference = torch.from_numpy(dequantize(np.asarray(tensor.data), qtype).reshape(48, 96))
    weight = int8_block_weight(tensor)
    assert weight.shape == (48, 96) and weight.codes.dtype == torch.int8
    assert (weight.mins is None) == (qtype == Q.Q8_0)
    assert torch.equal(_bits(weight.dequantize()), _bits(reference))
    # llama.cpp's q/k permutation: undone on the rows of codes, scales and mins alike.
    permuted = int8_block_weight(tensor, rope_heads=3)
    assert torch.equal(_bits(permuted.dequantize()), _bits(torch.from_numpy(unpermute_rope_rows(reference.numpy(), 3))))


def _fused_linear(parts: list[Int8BlockWeight], bias: torch.Tensor | None, with_mins: bool) -> Linear:
    rows = sum(p.shape[0] for p in parts)
    linear = Linear(parts[0].shape[1], rows, bias is not None, ("unused",), Int8BlockLinearMethod(with_mins))
    with torch.no_grad():
        row = 0
        for part in parts:
            linear.method.load_rows(linear, part, row)
            row += part.shape[0]
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_INT8_ROWS])
def test_kernel_matches_float32_matmul_on_a_fused_q4_1_q8_0_layer(tmp_path: Path, rows: int):
    tensors = _gguf_tensors(tmp_path, {"q": (_matrix(40, 320, 1), Q.Q4_1), "k": (_matrix(30, 320, 2), Q.Q8_0)})
    q4, q8 = int8_block_weight(tensors["q"]), int8_block_weight(tensors["k"])
    gen = torch.Generator().manual_seed(rows)
    linear = _fused_linear([q4, q8], torch.randn(70, generator=gen), with_mins=True)
    # The Q8_0 rows got offsets of -0.0: the dense weight is still gguf's, bit for bit.
    expected = torch.cat([q4.dequantize(), q8.dequantize()])
    assert torch.equal(_bits(linear.weight), _bits(expected))
    x = torch.randn(rows, 320, generator=gen)
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    # ... and the kernel gives the Q8_0 rows exactly what it gives them stored without offsets.
    q8_alone = _fused_linear([q8], None, with_mins=False)
    assert torch.equal(_fused_linear([q4, q8], None, with_mins=True)(x)[:, 40:], q8_alone(x))
    big = torch.randn(MAX_INT8_ROWS + 1, 320, generator=gen)  # above MAX_INT8_ROWS: the float32 GEMM itself
    assert torch.equal(linear(big), F.linear(big, linear.weight, linear.bias))


def test_choice_of_method():
    q4 = TensorInfo((64, 64), Storage.INT8_BLOCKS_WITH_MINS)
    q8 = TensorInfo((64, 64), Storage.INT8_BLOCKS)
    f32 = TensorInfo((64, 64), Storage.DENSE)
    cpu = torch.device("cpu")
    assert choose_linear_method([q4, f32], torch.float32, cpu) is DENSE  # no exact int8 form for the F32 part
    assert choose_linear_method([q4, q4], torch.bfloat16, cpu) is DENSE  # int8 path only in float32
    assert choose_linear_method([q4], torch.float32, torch.device("cuda")) is DENSE
    if small_batch_kernel() is not None:
        mixed = choose_linear_method([q4, q8], torch.float32, cpu)
        assert isinstance(mixed, Int8BlockLinearMethod) and mixed.with_mins
        only_q8 = choose_linear_method([q8], torch.float32, cpu)
        assert isinstance(only_q8, Int8BlockLinearMethod) and not only_q8.with_mins


@pytest.fixture(scope="module")
def quantised_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelArchConfig, object]:
    """A tiny Llama as a Q4_1 GGUF, with one fused layer mixing Q4_1 and Q8_0 (layer 0's q/k/v),
    one mixing Q4_1 and F32 (layer 1's gate/up), and a Q8_0 head."""
    root = tmp_path_factory.mktemp("q")
    hf_dir = write_tiny_checkpoint(root / "hf", arch="llama", seed=3, init_std=0.3)
    overrides = {"blk.0.attn_k.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.F32, "output.weight": Q.Q8_0}
    path = write_tiny_gguf(root / "tiny.gguf", hf_dir, tensor_type=Q.Q4_1, override_types=overrides)
    reader = open_gguf(path)
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    return arch, load_gguf_weights(reader, arch, source=str(path))


@needs_kernel
def test_model_with_int8_layers_matches_the_all_dense_model(quantised_gguf):
    arch, weights = quantised_gguf
    fast = build_model(arch, weights, torch.float32, "cpu")
    reference = build_model(arch, weights, torch.float32, "cpu", int8_linears=False)
    layer0, layer1 = fast.layers
    qkv = layer0.self_attn.qkv_proj.method
    assert isinstance(qkv, Int8BlockLinearMethod) and qkv.with_mins  # Q4_1 + Q8_0: exact with -0.0 offsets
    assert type(layer1.mlp.gate_up_proj.method) is DenseLinearMethod  # Q4_1 + F32: dense
    head = fast.lm_head.method
    assert isinstance(head, Int8BlockLinearMethod) and not head.with_mins
    assert isinstance(layer1.self_attn.o_proj.method, Int8BlockLinearMethod)
    assert all(type(m.method) is DenseLinearMethod for m in reference.modules() if isinstance(m, Linear))
    for got, want in zip(fast.parameters(), reference.parameters()):  # the very same float32 weights
        assert torch.equal(_bits(got), _bits(want))
    prompt = torch.randint(0, 1000, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    assert greedy_decode(fast, prompt, 24) == greedy_decode(reference, prompt, 24)
    short = [prompt[:3], prompt[:1]]  # few rows: the prompt forward itself takes the kernel
    for got, want in zip(prompt_logits(fast, short), prompt_logits(reference, short)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Many rows: the dense GEMM on identical weights, so identical logits.
    assert torch.equal(prompt_logits(fast, [prompt])[0], prompt_logits(reference, [prompt])[0])


def test_half_precision_model_from_int8_blocks_is_dense(quantised_gguf):
    arch, weights = quantised_gguf
    model = build_model(arch, weights, torch.bfloat16, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.method is DENSE and not hasattr(m, "codes") for m in linears)
    reference = build_model(arch, weights, torch.float32, "cpu", int8_linears=False)
    # Each bf16 weight is the float32 weight rounded once, as `.to(bfloat16)` rounds it.
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, reference.layers[0].self_attn.qkv_proj.weight.bfloat16())


@pytest.mark.slow
def test_default_model_codes_rebuild_gguf_dequantize_bit_for_bit():
    """Every Q4_1 / Q8_0 tensor of the real default model file: our codes -> float32 == gguf's dequantize."""
    reader = open_gguf(default_model_path())
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    checked = 0
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name is None or tensor.tensor_type not in INT8_BLOCK_TYPES:
            continue
        heads = {".q_proj.": arch.num_attention_heads, ".k_proj.": arch.num_key_value_heads}
        rope_heads = next((h for key, h in heads.items() if key in name), None)
        reference = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if rope_heads is not None:
            reference = unpermute_rope_rows(reference, rope_heads)
        ours = int8_block_weight(tensor, rope_heads).dequantize()
        assert torch.equal(_bits(ours), _bits(torch.from_numpy(np.ascontiguousarray(reference)))), name
        checked += 1
    assert checked == 30 * 7 + 1  # every projection (Q4_1) and the embedding (Q8_0)
