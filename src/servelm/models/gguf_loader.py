"""Load a llama.cpp GGUF file: metadata -> ModelArchConfig, tensors -> lazy HF-named weights, tokenizer.

GGUF differs from a Hugging Face checkpoint in four ways, each undone here:
1. names: `blk.N.attn_q.weight` instead of `model.layers.N.self_attn.q_proj.weight`;
2. shapes: GGUF lists dimensions fastest-first (`[in, out]`), the reverse of torch (`[out, in]`);
3. values: most tensors are block-quantised. Q4_0, Q4_1 and Q8_0 are handed out as they are
   stored, the file's block bytes (`BlockWeight`); F32 / F16 as such; the other types (K-quants...)
   dequantised to float32;
4. layout: for the `llama` arch, llama.cpp's converter permutes the rows of q_proj/k_proj so that
   its rope, which rotates adjacent pairs, equals HF's rotate_half; we permute them back (on
   the rows of blocks, for block-quantised tensors).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from servelm.gguf_file import GGUFFile, read_gguf
from servelm.models.arch import ModelArchConfig, UnsupportedModelError, UnsupportedQuantizationError
from servelm.models.gguf_blocks import BLOCK, BlockType, BlockWeight
from servelm.models.weights import CheckpointWeights, Storage, TensorInfo, Weight, select_model_weights, slice_weight
from servelm.tokenization.loading import load_gguf_tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's `general.architecture` -> Hugging Face class. Mistral files also say "llama".
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_Q = GGMLQuantizationType
# Types whose dequantisation in the `gguf` package is plain numpy and matches llama.cpp.
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
})  # fmt: skip
# Types handed out as the file's blocks (gguf_blocks.py), which the block kernel reads as they are.
BLOCK_TYPES: dict[GGMLQuantizationType, BlockType] = {
    _Q.Q4_0: BlockType.Q4_0,
    _Q.Q4_1: BlockType.Q4_1,
    _Q.Q8_0: BlockType.Q8_0,
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def load_gguf(path: Path) -> tuple[ModelArchConfig, CheckpointWeights, Any]:
    """(arch, lazy weights by HF name, tokenizer) of a GGUF file; the tensors are read when the model copies them."""
    started = time.perf_counter()
    reader = open_gguf(path)
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    weights = load_gguf_weights(reader, arch, source=str(path))
    logger.info("loaded %s weights in %.1f s", path.name, time.perf_counter() - started)
    return arch, weights, load_gguf_tokenizer(path, reader)  # the header parsed once, for both


def open_gguf(path: Path) -> GGUFFile:
    """`path`'s metadata and tensor directory (memory-mapped, read-only); ValueError naming the file if unreadable."""
    return read_gguf(path)


def gguf_hf_config(reader: GGUFFile) -> dict[str, Any]:
    """The GGUF metadata as a Hugging Face `config.json` dict (what `ModelArchConfig.from_hf_config` reads)."""
    name = _field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {name!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    num_heads = int(_field(reader, f"{name}.attention.head_count"))
    hidden = int(_field(reader, f"{name}.embedding_length"))
    head_dim = _field(reader, f"{name}.attention.key_length", None) or _field(
        reader, f"{name}.rope.dimension_count", hidden // num_heads
    )
    vocab = _field(reader, f"{name}.vocab_size", None) or _vocab_size_from_tokens(reader)
    rope_theta = float(_field(reader, f"{name}.rope.freq_base", 10000.0))
    # Instruct models end a turn with `eot` while `eos` is the document end; stop on both.
    eos_ids = [_field(reader, f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id")]
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[name]],
        "model_type": name,
        "num_hidden_layers": int(_field(reader, f"{name}.block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{name}.feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{name}.attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_field(reader, f"{name}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(_field(reader, f"{name}.context_length", 2048)),
        "vocab_size": int(vocab),
        # llama.cpp writes `output.weight` only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": name == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": list(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        "rope_scaling": _rope_scaling(reader, name, rope_theta),
    }
    return config


def load_gguf_weights(reader: GGUFFile, arch: ModelArchConfig, source: str) -> CheckpointWeights:
    """The tensors the model uses, by HF name, validated against `arch`; each is decoded when accessed.

    Tensor types are checked here, before any is read (UnsupportedQuantizationError).
    """
    tensors: dict[str, ReaderTensor] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue  # e.g. rope_freqs.weight, already folded into arch.rope_scaling
        _check_supported(tensor, source)
        tensors[hf_name] = tensor
    infos = {name: TensorInfo(_torch_shape(t), _storage(t.tensor_type)) for name, t in tensors.items()}

    def read_shard(name: str, rows: range | None, columns: range | None) -> Weight:
        # Only `rows` of the file's blocks are read (a tensor-parallel rank's part); columns
        # are cut after (blocks stay blocks when the cut falls on a block boundary).
        tensor = tensors[name]
        rope_heads = None
        if arch.architecture == "LlamaForCausalLM" and (".q_proj." in name or ".k_proj." in name):
            rope_heads = arch.num_attention_heads if ".q_proj." in name else arch.num_key_value_heads
        if tensor.tensor_type in BLOCK_TYPES:
            return slice_weight(block_weight(tensor, rope_heads, rows), None, columns)
        values = dequantize_tensor(tensor, source, rows)
        if rope_heads is not None:
            values = unpermute_rope_rows(values, _heads_in_rows(rope_heads, _torch_shape(tensor)[0], rows))
        if columns is not None:
            values = np.ascontiguousarray(values[:, columns.start : columns.stop])
        return torch.from_numpy(values)

    def read(name: str) -> Weight:
        return read_shard(name, None, None)

    return select_model_weights(CheckpointWeights(infos, read, source, read_shard), arch)


def gguf_to_hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors the model has no use for."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_TENSOR_RE.match(name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    layer, leaf, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[leaf]}.{kind}"


def dequantize_tensor(tensor: ReaderTensor, source: str, rows: range | None = None) -> np.ndarray:
    """Writable, in torch dimension order (`[out, in]`): F32 / F16 as stored, other types as float32.
    `rows`: only those rows (of dim 0) are read and decoded."""
    _check_supported(tensor, source)
    shape = _torch_shape(tensor)
    # np.asarray drops the np.memmap subclass, whose per-slice overhead doubles dequantisation time.
    # Its rows are the tensor's (a quantised one's as bytes), so a row slice is a slice of the blocks.
    data = np.asarray(tensor.data)
    if rows is not None:
        data, shape = data[rows.start : rows.stop], (len(rows), *shape[1:])
    if tensor.tensor_type in (_Q.F32, _Q.F16):
        # A copy out of the read-only memory map, so torch may own it.
        return np.array(data, order="C").reshape(shape)
    values = dequantize(data, tensor.tensor_type).reshape(shape)
    return np.require(values, dtype=np.float32, requirements=["C", "W"])


def _storage(tensor_type: GGMLQuantizationType) -> Storage:
    block_type = BLOCK_TYPES.get(tensor_type)
    return Storage.DENSE if block_type is None else Storage.of_blocks(block_type)


def block_weight(tensor: ReaderTensor, rope_heads: int | None = None, row_range: range | None = None) -> BlockWeight:
    """A Q4_0 / Q4_1 / Q8_0 tensor's blocks, copied out of the file as they are (nothing decoded).

    `rope_heads`: undo llama.cpp's q/k row permutation over that many heads, on the raw block rows
    (a row's blocks move together). `row_range`: only those rows (whole heads when `rope_heads` is given).
    """
    rows, cols = _torch_shape(tensor)
    block_type = BLOCK_TYPES[tensor.tensor_type]
    # [N, K/32, bytes per block], a view of the memory map.
    raw = np.asarray(tensor.data).reshape(rows, cols // BLOCK, block_type.block_bytes)
    if row_range is not None:
        if rope_heads is not None:
            rope_heads = _heads_in_rows(rope_heads, rows, row_range)
        raw = raw[row_range.start : row_range.stop]
    if rope_heads is not None:
        raw = unpermute_rope_rows(raw, rope_heads)
    return BlockWeight(block_type, torch.from_numpy(np.array(raw, order="C")))  # a copy torch may own


def _heads_in_rows(num_heads: int, total_rows: int, rows: range | None) -> int:
    """How many of a q/k tensor's `num_heads` heads `rows` spans; they must be whole heads (llama.cpp's
    rope permutation moves rows within a head only, so a whole-head slice is unpermuted on its own)."""
    if rows is None:
        return num_heads
    head_rows = total_rows // num_heads
    if rows.start % head_rows or rows.stop % head_rows:
        raise ValueError(f"rows {rows.start}..{rows.stop} cut a head of {head_rows} rows of a rope-permuted tensor")
    return len(rows) // head_rows


def _check_supported(tensor: ReaderTensor, source: str) -> None:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedQuantizationError(
            f"tensor {tensor.name!r} in {source} is stored as {tensor.tensor_type.name}, which servelm cannot "
            f"dequantize; supported types: {sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}"
        )


def _torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))


def unpermute_rope_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (`convert_hf_to_gguf.py`, `LlamaModel.permute`).

    llama.cpp wrote, per head, rows [x0..x(d/2-1) | y0..y(d/2-1)] as interleaved pairs
    [x0 y0 x1 y1 ...] via reshape(h, 2, d/2).swapaxes(1, 2); reading the rows as
    (h, d/2, 2) and swapping back restores HF's halves layout. Works for weights and biases.
    """
    rows = values.shape[0]
    grouped = values.reshape(num_heads, rows // num_heads // 2, 2, *values.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(values.shape))


def _rope_scaling(reader: GGUFFile, name: str, rope_theta: float) -> dict[str, Any] | None:
    kind = _field(reader, f"{name}.rope.scaling.type", None)
    if kind not in (None, "none"):
        factor = float(_field(reader, f"{name}.rope.scaling.factor", 1.0))
        original = _field(reader, f"{name}.rope.scaling.original_context_length", None)
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling  # arch.py rejects types it does not implement (yarn...), naming them
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is None:
        return None
    return llama3_scaling_from_rope_freqs(dequantize_tensor(rope_freqs, "rope_freqs.weight"), rope_theta)


def llama3_scaling_from_rope_freqs(divisors: np.ndarray, rope_theta: float) -> dict[str, Any]:
    """Llama 3.1+ GGUFs store rope scaling as per-frequency divisors (`rope_freqs.weight`), not parameters.

    Recover the parameters by recomputing the divisors llama.cpp's converter derives from
    Meta's published settings (low 1, high 4, original context 8192) and comparing.
    """
    factor, low, high, original = float(divisors.max()), 1.0, 4.0, 8192
    head_dim = 2 * divisors.shape[0]
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    if not np.allclose(expected, divisors, rtol=1e-4):
        raise UnsupportedModelError(
            f"rope_freqs.weight does not match Llama-3 rope scaling (factor {factor}, low 1, high 4, "
            f"original context 8192); servelm cannot reproduce this rope scaling"
        )
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}  # fmt: skip


def _vocab_size_from_tokens(reader: GGUFFile) -> int:
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError("GGUF file has neither a vocab_size, a token list nor token_embd.weight")
    return int(embedding.shape[1])  # GGUF order: [hidden, vocab]


_REQUIRED = object()


def _field(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    if key not in reader.metadata:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file {reader.path} lacks the required metadata key {key!r}")
        return default
    return reader.metadata[key]
