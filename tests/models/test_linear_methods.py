"""Linear methods: GGUF Q4_0 / Q4_1 / Q8_0 tensors kept as the file's blocks rebuild gguf's float32 weights
bit for bit, the block method's small-batch kernel agrees with the float32 matmul (the dense path), layers
whose parts are stored differently are dense, and a whole model with block layers decodes like the all-dense one."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from servelm.default_model import default_model_path
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.gguf_blocks import BlockType, BlockWeight
from servelm.models.gguf_loader import (
    BLOCK_TYPES,
    block_weight,
    gguf_hf_config,
    gguf_to_hf_name,
    load_gguf_weights,
    open_gguf,
    unpermute_rope_rows,
)
from servelm.models.linear_methods import (
    DENSE,
    MAX_BLOCK_ROWS,
    BlockLinearMethod,
    DenseLinearMethod,
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


def test_block_sizes_are_ggmls():
    for qtype, block_type in BLOCK_TYPES.items():
        assert (block_type.value, block_type.block_bytes) == (qtype.value, GGML_QUANT_SIZES[qtype][1])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_blocks_from_the_file_rebuild_gguf_dequantize_bit_for_bit(tmp_path: Path, qtype: Q):
    tensor = _gguf_tensors(tmp_path, {"w": (_matrix(48, 96, 0), qtype)})["w"]
    reference = torch.from_numpy(dequantize(np.asarray(tensor.data), qtype).reshape(48, 96))
    weight = block_weight(tensor)
    assert weight.shape == (48, 96) and weight.blocks.dtype == torch.uint8
    assert weight.block_type is BLOCK_TYPES[qtype]
    assert torch.equal(_bits(weight.dequantize()), _bits(reference))
    # llama.cpp's q/k permutation: undone on the rows of blocks.
    permuted = block_weight(tensor, rope_heads=3)
    assert torch.equal(_bits(permuted.dequantize()), _bits(torch.from_numpy(unpermute_rope_rows(reference.numpy(), 3))))


def _fused_linear(parts: list[BlockWeight], bias: torch.Tensor | None) -> Linear:
    rows = sum(p.shape[0] for p in parts)
    linear = Linear(parts[0].shape[1], rows, bias is not None, ("unused",), BlockLinearMethod(parts[0].block_type))
    with torch.no_grad():
        row = 0
        for part in parts:
            linear.method.load_rows(linear, part, row)
            row += part.shape[0]
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 3, MAX_BLOCK_ROWS])
def test_kernel_matches_float32_matmul_on_a_fused_layer(tmp_path: Path, qtype: Q, rows: int):
    tensors = _gguf_tensors(tmp_path, {"q": (_matrix(40, 320, 1), qtype), "k": (_matrix(30, 320, 2), qtype)})
    q, k = block_weight(tensors["q"]), block_weight(tensors["k"])
    gen = torch.Generator().manual_seed(rows)
    linear = _fused_linear([q, k], torch.randn(70, generator=gen))
    assert torch.equal(_bits(linear.weight), _bits(torch.cat([q.dequantize(), k.dequantize()])))  # gguf's, bit for bit
    x = torch.randn(rows, 320, generator=gen)
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    big = torch.randn(MAX_BLOCK_ROWS + 1, 320, generator=gen)  # above MAX_BLOCK_ROWS: the float32 GEMM itself
    assert torch.equal(linear(big), F.linear(big, linear.weight, linear.bias))


def test_loading_blocks_of_another_type_is_refused(tmp_path: Path):
    tensors = _gguf_tensors(tmp_path, {"q": (_matrix(40, 64, 1), Q.Q4_1), "k": (_matrix(30, 64, 2), Q.Q8_0)})
    with pytest.raises(TypeError, match="Q4_1 BlockLinearMethod loads Q4_1 blocks, got Q8_0"):
        _fused_linear([block_weight(tensors["q"]), block_weight(tensors["k"])], None)


def is_dense(method: object) -> bool:
    """Dense, not blocks: on CPU in float32 a method of the layer's own (its packed GEMM), else DENSE."""
    return type(method) is DenseLinearMethod


def test_choice_of_method():
    q4_0, q4_1, q8 = (TensorInfo((64, 64), s) for s in (Storage.Q4_0, Storage.Q4_1, Storage.Q8_0))
    f32 = TensorInfo((64, 64), Storage.DENSE)
    cpu = torch.device("cpu")
    assert is_dense(choose_linear_method([q4_1, f32], torch.float32, cpu))  # no block form for the F32 part
    assert is_dense(choose_linear_method([q4_1, q8], torch.float32, cpu))  # one layer, one block type
    assert choose_linear_method([q4_1, q4_1], torch.bfloat16, cpu) is DENSE  # block path only in float32
    assert choose_linear_method([q4_1], torch.float32, torch.device("cuda")) is DENSE
    if small_batch_kernel() is not None:
        for info in (q4_0, q4_1, q8):
            method = choose_linear_method([info, info], torch.float32, cpu)
            assert isinstance(method, BlockLinearMethod) and method.block_type is info.storage.block_type


@pytest.fixture(scope="module")
def quantised_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelArchConfig, object]:
    """A tiny Llama as a Q4_1 GGUF, with one fused layer mixing Q4_1 and Q8_0 (layer 0's q/k/v),
    one mixing Q4_1 and F32 (layer 1's gate/up), a Q4_0 layer (layer 1's o_proj) and a Q8_0 head."""
    root = tmp_path_factory.mktemp("q")
    hf_dir = write_tiny_checkpoint(root / "hf", arch="llama", seed=3, init_std=0.3)
    overrides = {"blk.0.attn_k.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.F32, "blk.1.attn_output.weight": Q.Q4_0,
                 "output.weight": Q.Q8_0}  # fmt: skip
    path = write_tiny_gguf(root / "tiny.gguf", hf_dir, tensor_type=Q.Q4_1, override_types=overrides)
    reader = open_gguf(path)
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    return arch, load_gguf_weights(reader, arch, source=str(path))


@needs_kernel
def test_model_with_block_layers_matches_the_all_dense_model(quantised_gguf):
    arch, weights = quantised_gguf
    fast = build_model(arch, weights, torch.float32, "cpu")
    reference = build_model(arch, weights, torch.float32, "cpu", block_linears=False)
    layer0, layer1 = fast.layers
    assert type(layer0.self_attn.qkv_proj.method) is DenseLinearMethod  # Q4_1 + Q8_0: dense
    assert type(layer1.mlp.gate_up_proj.method) is DenseLinearMethod  # Q4_1 + F32: dense
    block_types = {"head": fast.lm_head, "Q4_0": layer1.self_attn.o_proj, "Q4_1": layer0.mlp.down_proj}
    assert {name: getattr(m.method, "block_type", None) for name, m in block_types.items()} == {
        "head": BlockType.Q8_0, "Q4_0": BlockType.Q4_0, "Q4_1": BlockType.Q4_1,
    }  # fmt: skip
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


def test_half_precision_model_from_blocks_is_dense(quantised_gguf):
    arch, weights = quantised_gguf
    model = build_model(arch, weights, torch.bfloat16, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.method is DENSE and not hasattr(m, "blocks") for m in linears)
    reference = build_model(arch, weights, torch.float32, "cpu", block_linears=False)
    # Each bf16 weight is the float32 weight rounded once, as `.to(bfloat16)` rounds it.
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, reference.layers[0].self_attn.qkv_proj.weight.bfloat16())


@pytest.mark.slow
def test_default_model_blocks_rebuild_gguf_dequantize_bit_for_bit():
    """Every Q4_1 / Q8_0 tensor of the real default model file: our blocks -> float32 == gguf's dequantize."""
    reader = open_gguf(default_model_path())
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    checked = 0
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name is None or tensor.tensor_type not in BLOCK_TYPES:
            continue
        heads = {".q_proj.": arch.num_attention_heads, ".k_proj.": arch.num_key_value_heads}
        rope_heads = next((h for key, h in heads.items() if key in name), None)
        reference = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if rope_heads is not None:
            reference = unpermute_rope_rows(reference, rope_heads)
        ours = block_weight(tensor, rope_heads).dequantize()
        assert torch.equal(_bits(ours), _bits(torch.from_numpy(np.ascontiguousarray(reference)))), name
        checked += 1
    assert checked == 30 * 7 + 1  # every projection (Q4_1) and the embedding (Q8_0)
