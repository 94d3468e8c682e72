"""Load a Hugging Face model directory: config.json, safetensors weights (one file or shards), tokenizer.

    model_dir/
      config.json                      -> ModelArchConfig
      model.safetensors                -> weights, or
      model.safetensors.index.json     -> {"weight_map": {tensor name: shard file}}
      model-00001-of-0000N.safetensors
      tokenizer.json, tokenizer_config.json (+ chat_template.jinja)

An FP8 block-scaled checkpoint (config.json's quantization_config, fp8_blocks.py) hands out each
quantized `X.weight` as an Fp8BlockWeight read together with its `X.weight_scale_inv`; the scale
tensors themselves are not handed out. Any other quantization is refused before a tensor is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from servelm.models.arch import ModelArchConfig, UnsupportedQuantizationError
from servelm.models.fp8_blocks import SCALE_SUFFIX, Fp8BlockScheme, Fp8BlockWeight
from servelm.models.weights import CheckpointWeights, Storage, TensorInfo, Weight, select_model_weights, slice_weight
from servelm.tokenization.loading import load_hf_tokenizer

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Called with (file, tensor name) before a tensor's bytes are read: a streaming load waits there
# until those bytes have arrived (servelm.delivery.streaming).
BeforeRead = Callable[[Path, str], None]


def load_hf_directory(
    path: Path, before_read: BeforeRead | None = None
) -> tuple[ModelArchConfig, CheckpointWeights, PreTrainedTokenizerBase]:
    """(arch, lazy weights by HF name in the files' dtype, tokenizer) of a model directory; raises with the path named."""
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    config = read_config_json(path)
    arch = ModelArchConfig.from_hf_config(config)
    weights = with_fp8_blocks(load_safetensors_weights(path, before_read), Fp8BlockScheme.from_hf_config(config))
    return arch, select_model_weights(weights, arch), load_hf_tokenizer(path)


def read_hf_config(path: Path) -> ModelArchConfig:
    """Parse `config.json`; UnsupportedModelError (from arch.py) for an architecture servelm cannot run,
    UnsupportedQuantizationError for weights stored in a form it does not read."""
    config = read_config_json(path)
    Fp8BlockScheme.from_hf_config(config)  # refuses a quantization it cannot load, before anything else
    return ModelArchConfig.from_hf_config(config)


def read_config_json(path: Path) -> dict[str, Any]:
    """`config.json` of a model directory, parsed; raises naming the path when it is absent or not JSON."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model directory: expected {CONFIG_FILE} in it, found "
            f"{_listing(path)}"
        )
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    return config


def with_fp8_blocks(weights: CheckpointWeights, scheme: Fp8BlockScheme | None) -> CheckpointWeights:
    """The same tensors with each FP8-quantized `X.weight` read as an Fp8BlockWeight (codes and
    `X.weight_scale_inv`) and the scales hidden; each scale's shape is checked here, before any
    tensor is read. Without a scheme, a checkpoint that still carries scales is refused: its codes
    would otherwise load as if they were values."""
    scales = [name for name in weights if name.endswith(SCALE_SUFFIX)]
    if scheme is None:
        if scales:
            raise UnsupportedQuantizationError(
                f"{weights.source} holds FP8 scale tensors ({scales[0]!r}, {len(scales)} in all) but its config.json "
                "has no quantization_config saying how to apply them"
            )
        return weights
    quantized: set[str] = set()
    for scale_name in scales:
        name = scale_name.removesuffix(SCALE_SUFFIX)
        if name not in weights:
            raise ValueError(f"{weights.source} holds {scale_name!r} but no {name!r} for it to scale")
        shape, expected = weights.info(name).shape, None
        if len(shape) == 2:
            expected = scheme.scale_shape(shape)
        if expected is None or weights.info(scale_name).shape != expected:
            raise ValueError(
                f"{weights.source}: {scale_name!r} has shape {weights.info(scale_name).shape}; a {shape} weight "
                f"in blocks of {scheme.block_n}x{scheme.block_k} needs {expected}"
            )
        quantized.add(name)
    block = (scheme.block_n, scheme.block_k)
    infos = {name: TensorInfo(weights.info(name).shape, Storage.FP8_BLOCK, block) if name in quantized
             else weights.info(name) for name in weights if name not in scales}  # fmt: skip

    def read(name: str) -> Weight:
        if name not in quantized:
            return weights[name]
        scale = weights[name + SCALE_SUFFIX]
        assert isinstance(scale, torch.Tensor)  # safetensors hands out tensors
        codes = weights[name]
        assert isinstance(codes, torch.Tensor)
        try:
            return Fp8BlockWeight(codes, scale, scheme)
        except ValueError as exc:
            raise ValueError(f"{weights.source}: tensor {name!r}: {exc}") from exc

    def read_shard(name: str, rows: range | None, columns: range | None) -> Weight:
        if name in quantized:
            return slice_weight(read(name), rows, columns)  # the codes and scales whole, then cut
        return weights.read_shard(name, rows, columns)

    return CheckpointWeights(infos, read, weights.source, read_shard)


def load_safetensors_weights(path: Path, before_read: BeforeRead | None = None) -> CheckpointWeights:
    """Every tensor of the directory's safetensors file(s), read lazily, in the file's dtype, on CPU."""
    single, index = path / SINGLE_WEIGHTS_FILE, path / INDEX_FILE
    if single.is_file():
        return _safetensors_source({single: _tensor_infos(single)}, str(path), before_read)
    if index.is_file():
        return _load_sharded(index, str(path), before_read)
    hint = " (PyTorch .bin checkpoints are not supported; convert to safetensors)" if any(path.glob("*.bin")) else ""
    raise FileNotFoundError(
        f"no weights in {path}: expected {SINGLE_WEIGHTS_FILE} or {INDEX_FILE}, found {_listing(path)}{hint}"
    )


def _load_sharded(index_path: Path, source: str, before_read: BeforeRead | None) -> CheckpointWeights:
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"{index_path} is not a safetensors index with a 'weight_map': {exc}") from exc
    shard_names = sorted(set(weight_map.values()))
    # Check every shard before reading any, so a partial download fails fast and names all gaps.
    missing = [name for name in shard_names if not (index_path.parent / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index_path} lists shard(s) {missing} that are missing from {index_path.parent}"
        )
    shards = {index_path.parent / name: _tensor_infos(index_path.parent / name) for name in shard_names}
    found = {tensor for infos in shards.values() for tensor in infos}
    absent = [tensor for tensor in weight_map if tensor not in found]
    if absent:
        raise ValueError(
            f"{index_path} places tensor {absent[0]!r} in shard {weight_map[absent[0]]!r}, "
            f"but that shard does not contain it ({len(absent)} such tensor(s))"
        )
    return _safetensors_source(shards, source, before_read)


def _tensor_infos(file: Path) -> dict[str, TensorInfo]:
    """Names and shapes from the file's header; no tensor data is read."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return {name: TensorInfo(tuple(f.get_slice(name).get_shape()), Storage.DENSE) for name in f.keys()}


def _safetensors_source(
    shards: dict[Path, dict[str, TensorInfo]], source: str, before_read: BeforeRead | None = None
) -> CheckpointWeights:
    file_of = {name: file for file, infos in shards.items() for name in infos}

    def read(name: str) -> torch.Tensor:
        if before_read is not None:
            before_read(file_of[name], name)
        # Opened per tensor, so the file's memory map is released after each one: a load never
        # keeps the whole checkpoint mapped (resident) next to the model's own copy.
        with safe_open(str(file_of[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def read_shard(name: str, rows: range | None, columns: range | None) -> torch.Tensor:
        # A tensor-parallel rank's part: safetensors reads only those bytes.
        if before_read is not None:
            before_read(file_of[name], name)
        index: tuple[slice, ...] = (slice(None) if rows is None else slice(rows.start, rows.stop),)
        if columns is not None:
            index += (slice(columns.start, columns.stop),)
        with safe_open(str(file_of[name]), framework="pt", device="cpu") as f:
            return f.get_slice(name)[index]

    infos = {name: info for shard in shards.values() for name, info in shard.items()}
    return CheckpointWeights(infos, read, source, read_shard)


def _listing(path: Path, limit: int = 12) -> str:
    if not path.is_dir():
        return "no such directory"
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return "an empty directory"
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "")
