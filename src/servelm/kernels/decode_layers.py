"""The arguments of `csrc/decode_layers.c` (every decoder layer of a small decode step in one call),
checked and laid out as its C structs.

    prepare_layers(layers, geometry)                      once per KV pool: weights and pools checked,
                                                          their pointers in a C array
    DecodeLayersCall(prepared, hidden, ...)               once per step: the step's tensors checked

`CpuKernels.decode_layers` (kernels/cpu.py) runs a call. The structs mirror the C ones field for
field (ctypes lays them out as the C compiler does); a pointer is taken only from a tensor that
passed `check_tensor` and is held by the object that holds the pointer, so it stays alive.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelm.kernels.arguments import KernelArgumentError, check_shape, check_tensor
from servelm.kernels.cpu import BLOCK, BLOCK_BYTES, check_block_weight

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class FusedLoRA(ctypes.Structure):
    _fields_ = [("a", _ptr), ("bt", _ptr), ("widths", _ptr), ("W", _i64)]


class FusedLinear(ctypes.Structure):
    _fields_ = [("blocks", _ptr), ("bias", _ptr), ("n", _i64), ("k", _i64), ("type", _i64), ("lora", FusedLoRA)]


class FusedLayer(ctypes.Structure):
    _fields_ = [("qkv", FusedLinear), ("o", FusedLinear), ("gate_up", FusedLinear), ("down", FusedLinear),
                ("input_norm", _ptr), ("post_norm", _ptr), ("kv_pool", _ptr)]  # fmt: skip


class FusedStep(ctypes.Structure):
    _fields_ = [
        ("rows", _i64), ("hidden_size", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("block_size", _i64), ("max_blocks", _i64), ("max_len", _i64), ("num_blocks", _i64),
        ("block_tables", _ptr), ("seq_lens", _ptr), ("slots", _ptr), ("cos", _ptr), ("sin", _ptr),
        ("eps", _f32), ("scale", _f32), ("num_threads", _i64),
        ("normed", _ptr), ("qkv", _ptr), ("scores", _ptr), ("attn", _ptr), ("gate_up", _ptr), ("act", _ptr),
        ("lora_rows", _ptr), ("lora_slots", _i64), ("lora_width", _i64), ("lora_h", _ptr),
    ]  # fmt: skip


@dataclass(frozen=True)
class LayerGeometry:
    """What every layer shares (this rank's sizes)."""

    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float

    @property
    def qkv_size(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


@dataclass(frozen=True)
class StackedLoRA:
    """A linear's LoRA adapters by slot (servelm/lora/layers.py's layout), float32, contiguous."""

    a: torch.Tensor  # [slots, W, k]
    bt: torch.Tensor  # [slots, W, n]: B^T with the scaling folded in
    widths: torch.Tensor  # [slots] int64: the columns each slot's adapter uses


@dataclass(frozen=True)
class BlockMatrix:
    """One linear layer as GGUF blocks: [n, k / 32, block bytes] uint8 of ggml type `block_type`."""

    blocks: torch.Tensor
    block_type: int
    bias: torch.Tensor | None  # [n] float32
    lora: StackedLoRA | None = None  # adapters whose rows the call adds after the matmul


@dataclass(frozen=True)
class LayerTensors:
    qkv: BlockMatrix  # [(H + 2 KVH) D, hidden]
    o: BlockMatrix  # [hidden, H D]
    gate_up: BlockMatrix  # [2 I, hidden]
    down: BlockMatrix  # [hidden, I]
    input_norm: torch.Tensor  # [hidden] float32
    post_norm: torch.Tensor
    kv_pool: torch.Tensor  # [2, num_blocks, block_size, KVH, D] float32


class PreparedLayers:
    """Layers that passed the checks, as the C array, with the tensors its pointers name."""

    def __init__(self, layers: Sequence[LayerTensors], geometry: LayerGeometry, array: ctypes.Array[FusedLayer]):
        self.layers, self.geometry, self.array = tuple(layers), geometry, array
        pool = self.layers[0].kv_pool
        self.num_blocks, self.block_size = pool.shape[1], pool.shape[2]
        stacked = _stacked_loras(self.layers)
        # The adapter slots every linear has (0: no LoRA), and the widest linear's W (the scratch a row needs).
        self.lora_slots = stacked[0].a.shape[0] if stacked else 0
        self.lora_width = max((lora.a.shape[1] for lora in stacked), default=0)


def _stacked_loras(layers: Sequence[LayerTensors]) -> list[StackedLoRA]:
    """The LoRA stacks of every linear of `layers` that has one."""
    return [m.lora for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down) if m.lora is not None]


def _linear(name: str, matrix: BlockMatrix, n: int, k: int) -> FusedLinear:
    check_block_weight(f"{name}.blocks", matrix.blocks, matrix.block_type)
    check_shape(f"{name}.blocks", matrix.blocks, (n, k // BLOCK, BLOCK_BYTES[matrix.block_type]), "[n, k / 32, bytes]")
    bias = None
    if matrix.bias is not None:
        check_shape(f"{name}.bias", check_tensor(f"{name}.bias", matrix.bias, torch.float32, 1), (n,), "[n]")
        bias = matrix.bias.data_ptr()
    lora = FusedLoRA()
    if matrix.lora is not None:
        stacked = matrix.lora
        slots, width = stacked.a.shape[0], stacked.a.shape[1]
        check_shape(f"{name}.lora.a", check_tensor(f"{name}.lora.a", stacked.a, torch.float32, 3), (slots, width, k), "[slots, W, k]")
        check_shape(f"{name}.lora.bt", check_tensor(f"{name}.lora.bt", stacked.bt, torch.float32, 3), (slots, width, n), "[slots, W, n]")
        check_shape(f"{name}.lora.widths", check_tensor(f"{name}.lora.widths", stacked.widths, torch.int64, 1), (slots,), "[slots]")
        lora = FusedLoRA(stacked.a.data_ptr(), stacked.bt.data_ptr(), stacked.widths.data_ptr(), width)
    return FusedLinear(matrix.blocks.data_ptr(), bias, n, k, matrix.block_type, lora)


def prepare_layers(layers: Sequence[LayerTensors], geometry: LayerGeometry) -> PreparedLayers:
    """Check every layer's weights and pool against `geometry` (and the pools against each other)."""
    g = geometry
    if not layers or g.hidden_size % BLOCK or g.intermediate % BLOCK or (g.heads * g.head_dim) % BLOCK:
        raise KernelArgumentError(f"decode layers: need at least one layer and block-divisible sizes, got {g}")
    if g.heads % g.kv_heads or g.head_dim % 2:
        raise KernelArgumentError(f"decode layers: heads must group over KV heads and head_dim be even, got {g}")
    array = (FusedLayer * len(layers))()
    pool_shape = tuple(layers[0].kv_pool.shape)
    slot_counts = {lora.a.shape[0] for lora in _stacked_loras(layers)}
    if len(slot_counts) > 1:
        raise KernelArgumentError(f"decode layers: every linear's LoRA must have the same slots, found {sorted(slot_counts)}")
    for i, layer in enumerate(layers):
        pool = check_tensor(f"layer {i} kv_pool", layer.kv_pool, torch.float32, 5)
        check_shape(f"layer {i} kv_pool", pool, pool_shape, "layer 0's pool's")
        if pool_shape[0] != 2 or pool_shape[3:] != (g.kv_heads, g.head_dim):
            raise KernelArgumentError(f"layer {i} kv_pool: expected [2, blocks, block_size, {g.kv_heads}, "
                                      f"{g.head_dim}], found {pool_shape}")  # fmt: skip
        for norm_name in ("input_norm", "post_norm"):
            norm = check_tensor(f"layer {i} {norm_name}", getattr(layer, norm_name), torch.float32, 1)
            check_shape(f"layer {i} {norm_name}", norm, (g.hidden_size,), "[hidden]")
        array[i] = FusedLayer(
            _linear(f"layer {i} qkv", layer.qkv, g.qkv_size, g.hidden_size),
            _linear(f"layer {i} o", layer.o, g.hidden_size, g.heads * g.head_dim),
            _linear(f"layer {i} gate_up", layer.gate_up, 2 * g.intermediate, g.hidden_size),
            _linear(f"layer {i} down", layer.down, g.hidden_size, g.intermediate),
            layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), pool.data_ptr(),
        )  # fmt: skip
    return PreparedLayers(layers, geometry, array)


class DecodeLayersCall:
    """One step's arguments, checked, with its scratch; `CpuKernels.decode_layers` runs it."""

    def __init__(
        self,
        prepared: PreparedLayers,
        hidden: torch.Tensor,  # [B, hidden] float32: the embedding, or a layer's MLP output
        residual: torch.Tensor | None,  # [B, hidden] float32, the sum before `hidden`; None: layer 0's input
        block_tables: torch.Tensor,  # [B, max_blocks] int32 (a row per decode row)
        seq_lens: torch.Tensor,  # [B] int32: keys of each row, its own new one included
        max_len: int,  # >= every seq_len
        slots: torch.Tensor,  # [B] int64: where each row's new K/V go
        cos: torch.Tensor,  # [B, D/2] float32 (any [B, 1, D/2] view of it too)
        sin: torch.Tensor,
        scale: float,
        num_threads: int,
        lora_rows: torch.Tensor | None = None,  # [B] int64: each row's adapter slot, -1 for the base model's
    ) -> None:
        g = prepared.geometry
        check_tensor("hidden", hidden, torch.float32, 2)
        rows = hidden.shape[0]
        check_shape("hidden", hidden, (rows, g.hidden_size), "[rows, hidden]")
        self.has_residual = residual is not None
        self.residual = hidden.new_empty(hidden.shape) if residual is None else residual
        check_shape(
            "residual", check_tensor("residual", self.residual, torch.float32, 2), tuple(hidden.shape), "hidden's"
        )
        check_tensor("block_tables", block_tables, torch.int32, 2)
        check_shape("seq_lens", check_tensor("seq_lens", seq_lens, torch.int32, 1), (rows,), "[rows]")
        check_shape("slots", check_tensor("slots", slots, torch.int64, 1), (rows,), "[rows]")
        if block_tables.shape[0] != rows or max_len < 1:
            raise KernelArgumentError(f"block_tables: expected [{rows}, max_blocks] and max_len >= 1, found "
                                      f"{tuple(block_tables.shape)}, {max_len}")  # fmt: skip
        cos, sin = cos.reshape(rows, -1), sin.reshape(rows, -1)
        for name, angles in (("cos", cos), ("sin", sin)):
            check_shape(name, check_tensor(name, angles, torch.float32, 2), (rows, g.head_dim // 2), "[rows, D/2]")
        # Held for the step's pointers (and named in errors); cos / sin are their [rows, D/2] views.
        self.hidden, self.block_tables, self.seq_lens, self.slots = hidden, block_tables, seq_lens, slots
        self.angles = (cos, sin)
        scratch = torch.empty(rows * (g.hidden_size + g.qkv_size + g.heads * max_len + g.heads * g.head_dim
                                      + 3 * g.intermediate))  # fmt: skip
        sizes = (g.hidden_size, g.qkv_size, g.heads * max_len, g.heads * g.head_dim, 2 * g.intermediate, g.intermediate)
        parts = scratch.split([rows * size for size in sizes])
        self.scratch = scratch
        self.lora_rows = lora_rows if prepared.lora_slots else None  # no LoRA prepared: nothing to add
        lora_h = None
        if self.lora_rows is not None:
            check_shape("lora_rows", check_tensor("lora_rows", self.lora_rows, torch.int64, 1), (rows,), "[rows]")
            self.lora_h = torch.empty(rows * prepared.lora_width)
            lora_h = self.lora_h.data_ptr()
        self.step = FusedStep(
            rows, g.hidden_size, g.heads, g.kv_heads, g.head_dim, g.intermediate, prepared.block_size,
            block_tables.shape[1], max_len, prepared.num_blocks, block_tables.data_ptr(), seq_lens.data_ptr(),
            slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), g.eps, scale, num_threads,
            *(part.data_ptr() for part in parts),
            self.lora_rows.data_ptr() if self.lora_rows is not None else None, prepared.lora_slots,
            prepared.lora_width, lora_h,
        )  # fmt: skip
