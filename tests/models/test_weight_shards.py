"""Tensor-parallel shards of checkpoint tensors: what every loader's `read_shard` hands out is exactly
the whole tensor's rows and columns (bit for bit, rope un-permutation of q/k included), as
`TensorInfo.sharded` describes it, and both linear methods load a row shard and a column shard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from servelm.models.arch import ModelArchConfig
from servelm.models.gguf_blocks import BlockType, BlockWeight
from servelm.models.gguf_loader import gguf_hf_config, load_gguf_weights, open_gguf
from servelm.models.hf_loader import load_safetensors_weights
from servelm.models.linear_methods import DENSE, BlockLinearMethod, small_batch_kernel
from servelm.models.llama import Linear
from servelm.models.weights import CheckpointWeights, Storage, TensorInfo, dense_tensor, slice_weight
from servelm.testing.random_blocks import random_block_weight
from servelm.testing.tiny_model import write_tiny_checkpoint, write_tiny_gguf

# Rows: whole heads of 16 (q/k rows are rope-permuted per head in GGUF). Columns: on blocks of 32, and cutting them.
SHARDS = [(range(16, 32), None), (None, range(32, 64)), (range(16, 48), range(32, 64)), (range(0, 16), range(16, 48))]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("shards") / "hf", seed=5, attention_bias=True)


@pytest.fixture(scope="module")
def sources(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckpointWeights]:
    """The same tiny model through every loader: safetensors, and GGUF with Q4_1, Q8_0, F32 and a type
    dequantised on read (Q5_0) side by side."""
    root = tmp_path_factory.mktemp("gguf")
    types = {"blk.0.attn_k.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.F32, "blk.1.attn_q.weight": Q.Q5_0,
             "output.weight": Q.Q8_0}  # fmt: skip
    gguf_path = write_tiny_gguf(root / "m.gguf", hf_dir, tensor_type=Q.Q4_1, override_types=types)
    reader = open_gguf(gguf_path)
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    return {"safetensors": load_safetensors_weights(hf_dir), "gguf": load_gguf_weights(reader, arch, str(gguf_path))}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("loader", ["safetensors", "gguf"])
def test_read_shard_is_the_whole_tensor_cut(sources: dict[str, CheckpointWeights], loader: str):
    weights = sources[loader]
    storages = set()
    for name in weights:
        whole = dense_tensor(weights[name])
        info = weights.info(name)
        storages.add(info.storage)
        for rows, columns in SHARDS:
            if (rows is not None and rows.stop > whole.shape[0]) or (
                columns is not None and (whole.dim() == 1 or columns.stop > whole.shape[1])
            ):
                with pytest.raises(ValueError, match="is outside tensor"):
                    weights.read_shard(name, rows, columns)
                continue
            shard = weights.read_shard(name, rows, columns)
            expected = whole
            if rows is not None:
                expected = expected[rows.start : rows.stop]
            if columns is not None:
                expected = expected[:, columns.start : columns.stop]
            assert torch.equal(_bits(dense_tensor(shard)), _bits(expected)), (name, rows, columns)
            # Its storage and shape are what the factory was told before reading (method choice).
            assert TensorInfo.of(shard) == info.sharded(rows, columns), (name, rows, columns)
    if loader == "gguf":
        assert {Storage.Q8_0, Storage.Q4_1, Storage.DENSE} <= storages


def test_in_memory_tensors_are_cut_the_same_way():
    weight = random_block_weight(BlockType.Q4_1, 6, 96, torch.Generator().manual_seed(0))
    source = CheckpointWeights.from_tensors({"w": weight})
    aligned = source.read_shard("w", range(2, 5), range(32, 96))
    assert isinstance(aligned, BlockWeight) and aligned.blocks.is_contiguous()
    assert torch.equal(aligned.dequantize(), weight.dequantize()[2:5, 32:96])
    cut = source.read_shard("w", range(1, 3), range(8, 40))
    assert isinstance(cut, torch.Tensor) and torch.equal(cut, weight.dequantize()[1:3, 8:40])
    with pytest.raises(ValueError, match="cut blocks of 32"):
        weight.sliced(columns=range(8, 40))


@pytest.mark.parametrize("method", ["dense", "blocks"])
def test_linear_methods_load_a_row_shard_and_a_column_shard(method: str):
    full = random_block_weight(BlockType.Q4_1, 40, 128, torch.Generator().manual_seed(1))
    dense_full = full.dequantize()
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    for rows, columns in [(range(8, 24), None), (None, range(64, 128)), (range(0, 20), range(32, 96))]:
        shard = slice_weight(full, rows, columns)
        n = 40 if rows is None else len(rows)
        k = 128 if columns is None else len(columns)
        chosen = DENSE if method == "dense" else BlockLinearMethod(BlockType.Q4_1)
        linear = Linear(k, n, False, ("unused",), chosen)
        with torch.no_grad():
            linear.method.load_rows(linear, shard, 0)
        expected_w = dense_full[slice(None) if rows is None else slice(rows.start, rows.stop)]
        expected_w = expected_w[:, slice(None) if columns is None else slice(columns.start, columns.stop)]
        assert torch.equal(linear.weight, expected_w)
        xs = x if columns is None else x[:, columns.start : columns.stop]
        torch.testing.assert_close(linear(xs.contiguous()), F.linear(xs, expected_w), rtol=1e-5, atol=1e-5)
        if method == "blocks" and small_batch_kernel() is not None:
            assert torch.equal(linear.blocks, shard.blocks)  # the kernel's own blocks are the shard's
