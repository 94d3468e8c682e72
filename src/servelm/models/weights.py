"""The tensors a Llama-family model needs, by Hugging Face name and shape, their validation,
and `CheckpointWeights`, the lazy source every loader hands them out through.

Every loader ends here: whatever the file format, the model receives exactly the
names below with exactly these shapes, or the load fails naming the tensor. Tensors
come in the file's own dtype (bf16 stays bf16), for GGUF Q4_0 / Q4_1 / Q8_0 as the file's
blocks (`BlockWeight`), for FP8 block-scaled checkpoints as codes and scales (`Fp8BlockWeight`);
the model converts each one as it copies it into its parameter.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from servelm.models.arch import ModelArchConfig
from servelm.models.fp8_blocks import Fp8BlockWeight
from servelm.models.gguf_blocks import BLOCK, BlockType, BlockWeight
from servelm.models.moe_weights import moe_weight_shapes

# How many problems one error message lists before summarising the rest.
_MAX_REPORTED = 5
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
logger = logging.getLogger(__name__)

# What a weight source hands out for one name.
Weight = torch.Tensor | BlockWeight | Fp8BlockWeight
# Reads the part of a tensor a tensor-parallel rank keeps: (name, rows, columns), None meaning all.
ShardReader = Callable[[str, range | None, range | None], Weight]


class WeightShapeError(ValueError):
    """A checkpoint's tensors do not match its config: a tensor is missing or has the wrong shape."""


class Storage(enum.Enum):
    """How a tensor is handed out: what the model may do with it without reading it."""

    DENSE = "dense"  # a torch.Tensor in the file's dtype
    Q4_0 = "q4_0"  # a BlockWeight of that block type (gguf_blocks.py)
    Q4_1 = "q4_1"
    Q8_0 = "q8_0"
    FP8_BLOCK = "fp8_block"  # an Fp8BlockWeight (fp8_blocks.py)

    @property
    def block_type(self) -> BlockType | None:
        """The GGUF block type a block storage holds; None for DENSE and FP8_BLOCK."""
        return None if self in (Storage.DENSE, Storage.FP8_BLOCK) else BlockType[self.name]

    @classmethod
    def of_blocks(cls, block_type: BlockType) -> Storage:
        return cls[block_type.name]


@dataclass(frozen=True)
class TensorInfo:
    """What is known about a tensor before reading it."""

    shape: tuple[int, ...]  # torch order, [out, in] for a matrix
    storage: Storage
    fp8_block: tuple[int, int] | None = None  # FP8_BLOCK: weight (rows, columns) per scale

    @classmethod
    def of(cls, weight: Weight) -> TensorInfo:
        if isinstance(weight, BlockWeight):
            return cls(tuple(weight.shape), Storage.of_blocks(weight.block_type))
        if isinstance(weight, Fp8BlockWeight):
            return cls(tuple(weight.shape), Storage.FP8_BLOCK, (weight.scheme.block_n, weight.scheme.block_k))
        return cls(tuple(weight.shape), Storage.DENSE)

    def sharded(self, rows: range | None = None, columns: range | None = None) -> TensorInfo:
        """What `read_shard(name, rows, columns)` hands out: the shard's shape, and its storage
        (GGUF blocks whose columns are cut inside a block come out dequantised, DENSE; so does any
        cut of an FP8 weight)."""
        shape = list(self.shape)
        if rows is not None:
            shape[0] = len(rows)
        storage = self.storage
        if columns is not None:
            shape[1] = len(columns)
            if not blocks_aligned(columns):
                storage = Storage.DENSE
        if storage is Storage.FP8_BLOCK and (rows is not None or columns is not None):
            return TensorInfo(tuple(shape), Storage.DENSE)
        return TensorInfo(tuple(shape), storage, self.fp8_block)


def blocks_aligned(columns: range) -> bool:
    """Whether a column shard starts and ends on a block boundary (its blocks can be kept as they are)."""
    return columns.start % BLOCK == 0 and columns.stop % BLOCK == 0


def slice_weight(weight: Weight, rows: range | None = None, columns: range | None = None) -> Weight:
    """The part of a tensor a tensor-parallel rank keeps: rows of dim 0, columns of dim 1 (None: all).

    Dense tensors come back as views; blocks as blocks when the columns fall on block
    boundaries, else (only the kept rows) dequantised to float32 and cut; FP8 weights as
    `Fp8BlockWeight.sliced` says.
    """
    if isinstance(weight, Fp8BlockWeight):
        return weight.sliced(rows, columns)
    if isinstance(weight, BlockWeight):
        if columns is None or blocks_aligned(columns):
            return weight.sliced(rows, columns)
        weight = weight.sliced(rows).dequantize()
        rows = None
    if rows is not None:
        weight = weight[rows.start : rows.stop]
    if columns is not None:
        weight = weight[:, columns.start : columns.stop]
    return weight


class CheckpointWeights(Mapping[str, Weight]):
    """A checkpoint's tensors by Hugging Face name, each read from its file when it is accessed.

    Contract: `weights[name]` reads that one tensor anew (nothing is cached), so a caller
    copying tensors into a model one at a time never holds more than one extra tensor;
    accessing a name twice reads it twice. `info(name)` and iteration read nothing. The
    file(s) must stay in place while the source is in use. Built by the loaders
    (hf_loader, gguf_loader) or, for tensors already in memory, by `from_tensors`.
    """

    def __init__(
        self, infos: dict[str, TensorInfo], read: Callable[[str], Weight], source: str, read_shard: ShardReader | None = None
    ) -> None:
        self._infos = infos
        self._read = read
        # A loader that can read part of a tensor without the rest (safetensors slices, GGUF rows);
        # None: the whole tensor is read, then cut.
        self._read_shard = read_shard
        self.source = source  # the path the tensors come from, for messages

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Weight], source: str = "in-memory weights") -> CheckpointWeights:
        """Wrap tensors already in memory (a state dict); they are handed out as they are."""
        if isinstance(tensors, CheckpointWeights):
            return tensors
        return cls({name: TensorInfo.of(t) for name, t in tensors.items()}, tensors.__getitem__, source)

    def __getitem__(self, name: str) -> Weight:
        if name not in self._infos:
            raise KeyError(f"no tensor {name!r} in {self.source}")
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def read_shard(self, name: str, rows: range | None = None, columns: range | None = None) -> Weight:
        """Rows `rows` and columns `columns` of the tensor (None: all), read anew like `weights[name]`;
        what comes out is described by `info(name).sharded(rows, columns)`. Loaders that can read
        a part alone do (the rest of the tensor is neither read nor converted)."""
        if rows is None and columns is None:
            return self[name]
        if name not in self._infos:
            raise KeyError(f"no tensor {name!r} in {self.source}")
        shape = self._infos[name].shape
        for dim, kept in ((0, rows), (1, columns)):
            if kept is not None and not (dim < len(shape) and 0 <= kept.start <= kept.stop <= shape[dim]):
                raise ValueError(f"shard {kept.start}..{kept.stop} of dim {dim} is outside tensor {name!r} {shape}")
        if self._read_shard is not None:
            return self._read_shard(name, rows, columns)
        return slice_weight(self._read(name), rows, columns)

    def dense(self, name: str) -> torch.Tensor:
        """The tensor as a torch.Tensor: blocks dequantised to float32, dense ones as stored."""
        return dense_tensor(self[name])

    def restricted_to(self, names: list[str]) -> CheckpointWeights:
        """The same source showing only `names` (which must all be present)."""
        return CheckpointWeights({name: self._infos[name] for name in names}, self._read, self.source, self._read_shard)


def dense_tensor(weight: Weight) -> torch.Tensor:
    """A weight as a torch.Tensor: GGUF blocks and FP8 codes dequantised to float32, dense tensors unchanged."""
    return weight.dequantize() if isinstance(weight, BlockWeight | Fp8BlockWeight) else weight


def expected_weight_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model consumes, keyed by Hugging Face parameter name."""
    hidden = arch.hidden_size
    q_size = arch.num_attention_heads * arch.head_dim
    kv_size = arch.num_key_value_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, hidden)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        if arch.moe is not None and i in arch.moe.sparse_layers:
            shapes.update(moe_weight_shapes(arch, p))
        else:
            shapes[f"{p}.mlp.gate_proj.weight"] = (arch.intermediate_size, hidden)
            shapes[f"{p}.mlp.up_proj.weight"] = (arch.intermediate_size, hidden)
            shapes[f"{p}.mlp.down_proj.weight"] = (hidden, arch.intermediate_size)
        if arch.mla is not None:
            shapes.update(latent_attention_weight_shapes(arch, f"{p}.self_attn"))
            continue
        shapes[f"{p}.self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_size, hidden)
        if arch.attention_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (q_size,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv_size,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv_size,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, q_size)
        if arch.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (arch.head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (arch.head_dim,)
    shapes["model.norm.weight"] = (hidden,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    return shapes


def latent_attention_weight_shapes(arch: ModelArchConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor one layer's latent attention reads, by checkpoint name (`prefix`: "model.layers.3.self_attn")."""
    mla = arch.mla
    assert mla is not None
    hidden, heads = arch.hidden_size, arch.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.kv_a_proj_with_mqa.weight": (mla.latent_dim, hidden),
        f"{prefix}.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        f"{prefix}.kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        f"{prefix}.o_proj.weight": (hidden, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank is None:
        shapes[f"{prefix}.q_proj.weight"] = (heads * mla.qk_head_dim, hidden)
    else:
        shapes[f"{prefix}.q_a_proj.weight"] = (mla.q_lora_rank, hidden)
        shapes[f"{prefix}.q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes[f"{prefix}.q_b_proj.weight"] = (heads * mla.qk_head_dim, mla.q_lora_rank)
    if arch.attention_bias:
        shapes[f"{prefix}.kv_a_proj_with_mqa.bias"] = (mla.latent_dim,)
        shapes[f"{prefix}.o_proj.bias"] = (hidden,)
        if mla.q_lora_rank is not None:
            shapes[f"{prefix}.q_a_proj.bias"] = (mla.q_lora_rank,)
    return shapes


def validate_weights(weights: Mapping[str, Any], arch: ModelArchConfig, source: str) -> None:
    """Raise WeightShapeError naming each missing or mis-shaped tensor; extra tensors are ignored.

    `weights` maps names to anything with a `.shape` (tensors, `TensorInfo`s); nothing is read.
    Extras are legitimate (`rotary_emb.inv_freq` buffers, an `lm_head` saved next to
    tied embeddings); the loaders drop them with `select_model_weights`.
    """
    problems: list[str] = []
    for name, shape in expected_weight_shapes(arch).items():
        tensor = weights.get(name)
        if tensor is None:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
        elif tuple(tensor.shape) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    if problems:
        listed = "; ".join(problems[:_MAX_REPORTED])
        more = f"; and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise WeightShapeError(
            f"checkpoint {source} does not match its {arch.architecture} config "
            f"({arch.num_hidden_layers} layers, hidden {arch.hidden_size}): {listed}{more}"
        )


def select_model_weights(weights: CheckpointWeights, arch: ModelArchConfig) -> CheckpointWeights:
    """Validate the shapes (reading nothing), then show only the tensors the model consumes. Layers
    past num_hidden_layers (DeepSeek-V3's multi-token-prediction module, `model.layers.61`) are
    skipped, and the log says so."""
    validate_weights({name: weights.info(name) for name in weights}, arch, weights.source)
    extra_layers = sorted({int(m.group(1)) for name in weights if (m := _LAYER_INDEX.match(name))
                           and int(m.group(1)) >= arch.num_hidden_layers})  # fmt: skip
    if extra_layers:
        logger.info("%s: skipping layer(s) %s past num_hidden_layers (%d): a multi-token-prediction module, "
                    "which servelm does not run", weights.source, extra_layers, arch.num_hidden_layers)  # fmt: skip
    return weights.restricted_to(list(expected_weight_shapes(arch)))
