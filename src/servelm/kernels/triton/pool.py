"""How the kernels address one layer's paged KV pool: on the host a `KVPool` of K and V tensors
(and the scales of 8-bit codes), on the device the tile loads every attention kernel shares.

    pool:   [num_blocks, block_size, KVH, D]           (K, and V alike: views of one [2, ...] tensor)
    scales: [num_blocks, block_size, KVH] float32      (8-bit pools only: value = code * scale)

    position p of a request → block_table[p // block_size], offset p % block_size
    element (block, offset, head, d) at block * stride_block + offset * stride_token + head * stride_head + d

Any block size works: a key tile is TILE consecutive positions, each looked up in the block table
on its own (TILE, a power of two as `tl.arange` needs, is independent of the block size), so a
tile may span blocks and a block may span tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

# What a pool may store: the model's dtype, or 8-bit codes with per-(token, head) scales.
FULL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class KVPool:
    """One layer's K and V pools as the kernels read and write them."""

    key: torch.Tensor  # [num_blocks, block_size, KVH, D]
    value: torch.Tensor  # same shape and strides as key
    key_scales: torch.Tensor | None = None  # [num_blocks, block_size, KVH] float32 with 8-bit codes
    value_scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.key.dim() != 4 or self.key.shape != self.value.shape or self.key.stride() != self.value.stride():
            raise ValueError(
                f"K and V pools must be [num_blocks, block_size, KVH, D] with equal strides; got "
                f"{tuple(self.key.shape)} {self.key.stride()} and {tuple(self.value.shape)} {self.value.stride()}"
            )
        if self.key.stride(-1) != 1:
            raise ValueError("the KV pool's head_dim must be contiguous (stride 1)")
        if self.key.dtype not in FULL_DTYPES + CODE_DTYPES:
            raise ValueError(f"a KV pool of {self.key.dtype} is not supported; valid: {FULL_DTYPES + CODE_DTYPES}")
        quantized = self.key.dtype in CODE_DTYPES
        if quantized != (self.key_scales is not None and self.value_scales is not None):
            raise ValueError("8-bit KV codes need their key and value scales; a full-precision pool has none")
        if self.key_scales is not None and self.value_scales is not None:
            if self.key_scales.shape != self.key.shape[:3] or self.key_scales.dtype != torch.float32:
                raise ValueError(
                    f"scales must be float32 {tuple(self.key.shape[:3])}, got {tuple(self.key_scales.shape)}"
                )
            if self.key_scales.stride() != self.value_scales.stride():
                raise ValueError("key and value scales must have equal strides")

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]

    @property
    def head_dim(self) -> int:
        return self.key.shape[3]

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    def kernel_args(self) -> dict[str, Any]:
        """The pool as the kernels take it: `kv` = (K, V, K scales, V scales) pointers (the pools
        themselves stand in for the scales when unquantized: never read) and `kv_strides` = the
        pool's (block, token, head) strides, then the scales' (0 when unquantized)."""
        k_scales = self.key_scales if self.key_scales is not None else self.key
        v_scales = self.value_scales if self.value_scales is not None else self.value
        scale_strides = k_scales.stride()[:3] if self.key_scales is not None else (0, 0, 0)
        return {
            "kv": (self.key, self.value, k_scales, v_scales),
            "kv_strides": (*self.key.stride()[:3], *scale_strides),
            "QUANTIZED": self.quantized,
        }


@triton.jit
def paged_locations(block_table_row, positions, valid, BLOCK_SIZE: tl.constexpr):
    """Block id (int64) and in-block offset of each of `positions` ([N] int32) of one request whose
    block table row starts at `block_table_row`; masked positions read block 0."""
    block_ids = tl.load(block_table_row + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block_ids, positions % BLOCK_SIZE


@triton.jit
def pool_offsets(kv_strides, block_ids, offsets, heads):
    """Element offsets (of dim 0) of tokens at (block_ids [int64], offsets) for `heads` in the K/V
    pools, and of their scales; broadcast over the arguments' shapes."""
    values = block_ids * kv_strides[0] + offsets * kv_strides[1] + heads * kv_strides[2]
    scales = block_ids * kv_strides[3] + offsets * kv_strides[4] + heads * kv_strides[5]
    return values, scales


@triton.jit
def _load_tile(
    pool, scales, value_offsets, scale_offsets, dims, mask, valid, QUANTIZED: tl.constexpr, OUT_DTYPE: tl.constexpr
):
    x = tl.load(pool + value_offsets[:, None] + dims[None, :], mask=mask, other=0.0)
    if QUANTIZED:
        s = tl.load(scales + scale_offsets, mask=valid, other=0.0)
        return (x.to(tl.float32) * s[:, None]).to(OUT_DTYPE)
    return x.to(OUT_DTYPE)


@triton.jit
def load_kv_tiles(
    kv,  # (K, V, K scales, V scales) pointers (KVPool.kernel_args)
    kv_strides,
    block_ids,  # [N] int64
    offsets,  # [N]
    kv_head,
    dims,  # [DIM]
    valid,  # [N]: tokens to read (others read 0)
    head_dim,
    QUANTIZED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """K and V ([N, DIM] each) of N tokens at (block_ids, offsets) for KV head `kv_head`, in
    OUT_DTYPE (the query's); 8-bit codes are dequantized (code * scale in float32, as
    kv_storage.dequantize). Masked tokens and dims past head_dim read 0."""
    value_offsets, scale_offsets = pool_offsets(kv_strides, block_ids, offsets, kv_head)
    mask = valid[:, None] & (dims < head_dim)[None, :]
    k = _load_tile(kv[0], kv[2], value_offsets, scale_offsets, dims, mask, valid, QUANTIZED, OUT_DTYPE)
    v = _load_tile(kv[1], kv[3], value_offsets, scale_offsets, dims, mask, valid, QUANTIZED, OUT_DTYPE)
    return k, v
