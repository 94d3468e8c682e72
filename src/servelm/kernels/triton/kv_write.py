"""Reshape-and-cache: the step's new K/V ([T, KVH, D] each) into the paged pool at `slot_mapping`.

A program stores a few tokens (TOKENS x KVH rows of D values): slot = block_id * block_size +
offset (attention/backend.py), and each token's KVH x D values land at that block and offset of
the K and V pools. Every slot is written,
none skipped: a captured decode's padding rows write into the padding block (DecodeGraphBuffers),
where nobody reads.

For an 8-bit pool each (token, head) is quantized as `kv_storage.quantize` does: scale =
max(absmax over D / QMAX, float32 tiny), code = clamp(x / scale, -QMAX, QMAX) rounded half to
even (torch.round for int8; torch's cast to float8_e4m3fn rounds the same way), with IEEE
division (`div_rn`): the codes and scales equal the torch path's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.triton.launch import KernelLaunch, pow2_at_least
from servelm.kernels.triton.pool import KVPool, pool_offsets

# Largest code magnitude per 8-bit dtype, as kv_storage.QUANTIZED_MAX (kernels sit below attention/).
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@triton.jit
def _round_half_even(y):
    """torch.round of float32 `y` (|y| < 2^22), exactly: floor and y - floor(y) are exact, so
    only the tie needs care."""
    r = tl.floor(y)
    frac = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _round_to_e4m3(y):
    """float32 `y` (|y| <= 448) rounded half to even onto float8_e4m3fn's grid, as float32: 3
    mantissa bits, so the step at exponent e is 2^(e-3), and 2^-9 below the smallest normal
    exponent -6 (subnormals). Scaling by powers of two is exact, so the cast that follows is too
    (rounding in the cast itself is wrong under Triton 3.6's interpreter when it carries into the
    exponent: 124 became 64, not 128)."""
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(y * inverse_step) * step


@triton.jit
def _store_rows(
    x,  # [ROWS, DIM]: K or V of one (token, head) per row
    pool,
    scales,
    element_offsets,  # [ROWS, DIM] int64: where each element goes
    scale_offsets,  # [ROWS] int64: where each row's scale goes
    row_ok,  # [ROWS]: a real token and head (not padding up to the tile)
    mask,  # [ROWS, DIM]: a real row and dim
    QUANTIZED: tl.constexpr,
    INT_CODES: tl.constexpr,
    QMAX: tl.constexpr,
):
    if QUANTIZED:
        x32 = x.to(tl.float32)
        absmax = tl.max(tl.where(mask, tl.abs(x32), 0.0), axis=1)  # [ROWS]
        scale = tl.maximum(tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32)), 1.1754943508222875e-38)
        y = tl.math.div_rn(x32, scale[:, None])
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if INT_CODES:
            y = _round_half_even(y)
        else:
            y = _round_to_e4m3(y)
        tl.store(pool + element_offsets, y.to(pool.dtype.element_ty), mask=mask)
        tl.store(scales + scale_offsets, scale, mask=row_ok)
    else:
        tl.store(pool + element_offsets, x.to(pool.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key,  # [T, KVH, D]
    value,  # [T, KVH, D]
    slot_mapping,  # [T] long
    kv,  # (K, V, K scales, V scales): KVPool.kernel_args
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    kv_strides,
    num_tokens,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per program
    HEADS: tl.constexpr,  # num_kv_heads rounded up to a power of two
    DIM: tl.constexpr,  # head_dim rounded up to a power of two
    QUANTIZED: tl.constexpr,
    INT_CODES: tl.constexpr,
    QMAX: tl.constexpr,
):
    # Row r of the program's tile is token r // HEADS, KV head r % HEADS.
    rows = tl.arange(0, TOKENS * HEADS)
    tokens = tl.program_id(0) * TOKENS + rows // HEADS
    heads = rows % HEADS
    dims = tl.arange(0, DIM)
    row_ok = (tokens < num_tokens) & (heads < num_kv_heads)
    mask = row_ok[:, None] & (dims < head_dim)[None, :]
    slots = tl.load(slot_mapping + tokens, mask=row_ok, other=0).to(tl.int64)
    block_ids = slots // BLOCK_SIZE
    offsets = slots % BLOCK_SIZE
    value_offsets, scale_offsets = pool_offsets(kv_strides, block_ids, offsets, heads)  # [ROWS] each
    element_offsets = value_offsets[:, None] + dims[None, :]
    token_rows = tokens.to(tl.int64)
    k = tl.load(key + (token_rows * stride_kt + heads * stride_kh)[:, None] + dims[None, :], mask=mask, other=0.0)
    _store_rows(k, kv[0], kv[2], element_offsets, scale_offsets, row_ok, mask, QUANTIZED, INT_CODES, QMAX)
    v = tl.load(value + (token_rows * stride_vt + heads * stride_vh)[:, None] + dims[None, :], mask=mask, other=0.0)
    _store_rows(v, kv[1], kv[3], element_offsets, scale_offsets, row_ok, mask, QUANTIZED, INT_CODES, QMAX)


def write_kv_launch(key: torch.Tensor, value: torch.Tensor, pool: KVPool, slot_mapping: torch.Tensor) -> KernelLaunch:
    """key, value: [T, KVH, D] (head_dim contiguous); slot_mapping: [T] long pool slots."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or (num_kv_heads, head_dim) != (pool.num_kv_heads, pool.head_dim):
        raise ValueError(
            f"K {tuple(key.shape)} / V {tuple(value.shape)} do not match the pool's {pool.num_kv_heads} heads x {pool.head_dim}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, want ({num_tokens},)")
    heads = pow2_at_least(num_kv_heads)
    # About 4K elements per program: a few tokens of a large model, more of a small one.
    tokens_per_program = max(1, min(16, 4096 // (heads * pow2_at_least(head_dim))))
    tokens_per_program = 1 << (tokens_per_program.bit_length() - 1)  # a power of two (tl.arange)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    args = {
        "key": key,
        "value": value,
        "slot_mapping": slot_mapping,
        **pool.kernel_args(),
        "stride_kt": key.stride(0),
        "stride_kh": key.stride(1),
        "stride_vt": value.stride(0),
        "stride_vh": value.stride(1),
        "num_tokens": num_tokens,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "BLOCK_SIZE": pool.block_size,
        "TOKENS": tokens_per_program,
        "HEADS": heads,
        "DIM": pow2_at_least(head_dim),
        "INT_CODES": pool.key.dtype == torch.int8,
        "QMAX": _QMAX.get(pool.key.dtype, 1.0),
    }
    return KernelLaunch(_write_kv_kernel, (triton.cdiv(num_tokens, tokens_per_program),), args)


def write_kv(key: torch.Tensor, value: torch.Tensor, pool: KVPool, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots (quantized for an 8-bit pool). Overwrites the slots'
    previous contents (and scales); reads nothing else of the pool."""
    write_kv_launch(key, value, pool, slot_mapping).run()
