"""Paged decode attention: one query token per row over its request's blocks, GQA-aware, optionally
split over the context (flash-decoding).

Grid (rows, KVH, splits). A program owns one row, one KV head and one split of the row's context:
it loads the GROUP query heads that share the KV head as the rows of one [BLOCK_H, D] tile, so each
K/V tile is read once per KV head, and walks its keys TILE at a time (online_softmax):

    context of a row:  0 ............................................ seq_len
    splits (S = 4):    | split 0      | split 1      | split 2      | split 3 |
                       each cdiv(cdiv(seq_len, S), TILE) * TILE keys; the last one shorter or empty

`seq_len` is read per row from a device tensor and bounds the loop on the device: no host value
of it is needed, so a captured CUDA graph replays correctly after its buffers are refilled. With one
split the program writes the normalized output; with several it writes each split's normalized
output and log-sum-exp, and `split_merge` combines them.

Rows are the step's decode requests in batch order: row i is request `requests[i]` (its seq_len and
block-table row) whose token is batch row `token_rows[i]`; without those arrays row i is request i
and token i (a pure-decode batch, and every captured decode).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from servelm.kernels.triton.launch import KernelLaunch, dot_precision, pow2_at_least
from servelm.kernels.triton.online_softmax import attend_tile
from servelm.kernels.triton.pool import KVPool, load_kv_tiles, paged_locations
from servelm.kernels.triton.split_merge import merge_splits_launch

# Keys per loop step (a power of two; any block size, see pool.py).
DECODE_TILE = 64
# Splitting: each split keeps at least this many keys (below that the merge costs more than it
# parallelizes), and at most this many splits (a power of two, for the merge's tile).
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


@triton.jit
def _decode_kernel(
    out,  # [T, H, D]: the step's output; rows written here when NUM_SPLITS == 1
    part_out,  # [rows, H, NUM_SPLITS, DIM] float32: each split's normalized output
    part_lse,  # [rows, H, NUM_SPLITS] float32: each split's log2-sum-exp2 (-inf when empty)
    query,  # [T, H, D]
    kv,  # (K, V, K scales, V scales): KVPool.kernel_args
    block_table,  # [R, max_blocks] int32
    seq_lens,  # [R] int32
    requests,  # [rows] int32 (INDEXED only): request of each row
    token_rows,  # [rows] int32 (INDEXED only): batch row of each row's token
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    kv_strides,
    num_heads,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (tl.dot's rows)
    DIM: tl.constexpr,  # head_dim rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INDEXED: tl.constexpr,
    QUANTIZED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if INDEXED:
        request = tl.load(requests + row)
        token = tl.load(token_rows + row)
    else:
        request = row
        token = row
    seq_len = tl.load(seq_lens + request)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    group = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    dims = tl.arange(0, DIM)
    dim_ok = dims < head_dim
    q_mask = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        query + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0
    )

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DIM], tl.float32)
    table_row = block_table + request.to(tl.int64) * stride_table
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        block_ids, offsets = paged_locations(table_row, positions, valid, BLOCK_SIZE)
        k, v = load_kv_tiles(
            kv, kv_strides, block_ids, offsets, kv_head, dims, valid, head_dim, QUANTIZED, query.dtype.element_ty
        )
        row_max, row_sum, acc = attend_tile(
            q, k, v, valid[None, :], row_max, row_sum, acc, qk_scale, True, DOT_PRECISION
        )

    if NUM_SPLITS == 1:
        out_offsets = token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out + out_offsets, (acc / row_sum[:, None]).to(out.dtype.element_ty), mask=q_mask)
    else:
        # An empty split (a context shorter than the splits) sums to 0: output 0, lse -inf (weight 0).
        has_keys = row_sum > 0.0
        sum_safe = tl.where(has_keys, row_sum, 1.0)
        slot = (row.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out + slot[:, None] * DIM + dims[None, :], acc / sum_safe[:, None], mask=head_ok[:, None])
        tl.store(part_lse + slot, tl.where(has_keys, row_max + tl.log2(sum_safe), float("-inf")), mask=head_ok)


def choose_num_splits(num_rows: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per row (a power of two): enough (row, KV head, split) programs to give each of the
    device's `num_sms` multiprocessors two, while every split keeps MIN_KEYS_PER_SPLIT keys of the
    longest context `max_context`. A host decision from shapes only (a graph captures it)."""
    programs = max(1, num_rows * num_kv_heads)
    wanted = math.ceil(2 * num_sms / programs)
    affordable = max_context // MIN_KEYS_PER_SPLIT
    splits = max(1, min(wanted, affordable, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def decode_launches(
    out: torch.Tensor,  # [T, H, D]: rows of the decode tokens are written
    query: torch.Tensor,  # [T, H, D], head_dim contiguous
    pool: KVPool,
    block_table: torch.Tensor,  # [R, max_blocks] int32, on the pool's device
    seq_lens: torch.Tensor,  # [R] int32: context of each request, its new token included
    scale: float,
    *,
    requests: torch.Tensor | None = None,  # [rows] int32: see the module; None with token_rows None
    token_rows: torch.Tensor | None = None,  # [rows] int32
    num_splits: int = 1,
) -> list[KernelLaunch]:
    """The launches computing decode attention for every row (the attention kernel, and the merge
    when split); pure: builds the split buffers, runs nothing."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = pool.num_kv_heads
    if num_heads % num_kv_heads or head_dim != pool.head_dim or query.stride(-1) != 1:
        raise ValueError(
            f"query {tuple(query.shape)} (stride {query.stride()}) does not fit a pool of {num_kv_heads} KV heads "
            f"x {pool.head_dim} (heads a multiple of KV heads, head_dim equal and contiguous)"
        )
    if (requests is None) != (token_rows is None):
        raise ValueError("requests and token_rows go together")
    if num_splits < 1 or num_splits & (num_splits - 1) or num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be a power of two in 1..{MAX_SPLITS}, got {num_splits}")
    num_rows = requests.shape[0] if requests is not None else seq_lens.shape[0]
    group = num_heads // num_kv_heads
    dim = pow2_at_least(head_dim)
    split_shape = (num_rows, num_heads, num_splits)
    part_out = query.new_empty((*split_shape, dim) if num_splits > 1 else (0,), dtype=torch.float32)
    part_lse = query.new_empty(split_shape if num_splits > 1 else (0,), dtype=torch.float32)
    indexed = requests is not None
    args = {
        "out": out,
        "part_out": part_out,
        "part_lse": part_lse,
        "query": query,
        **pool.kernel_args(),
        "block_table": block_table,
        "seq_lens": seq_lens,
        "requests": requests if requests is not None else seq_lens,  # unread unless INDEXED
        "token_rows": token_rows if token_rows is not None else seq_lens,
        "qk_scale": scale * math.log2(math.e),
        "stride_qt": query.stride(0),
        "stride_qh": query.stride(1),
        "stride_ot": out.stride(0),
        "stride_oh": out.stride(1),
        "stride_table": block_table.stride(0),
        "num_heads": num_heads,
        "head_dim": head_dim,
        "GROUP": group,
        "BLOCK_H": pow2_at_least(group, 16),
        "DIM": dim,
        "BLOCK_SIZE": pool.block_size,
        "TILE": DECODE_TILE if head_dim <= 128 else DECODE_TILE // 2,
        "NUM_SPLITS": num_splits,
        "INDEXED": indexed,
        "DOT_PRECISION": dot_precision(query.dtype),
    }
    launches = [KernelLaunch(_decode_kernel, (num_rows, num_kv_heads, num_splits), args)]
    if num_splits > 1:
        launches.append(merge_splits_launch(out, part_out, part_lse, token_rows, head_dim))
    return launches


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    pool: KVPool,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    requests: torch.Tensor | None = None,
    token_rows: torch.Tensor | None = None,
    num_splits: int = 1,
) -> None:
    """Write the attention output of every decode row into its token's row of `out` (see
    `decode_launches` for the arguments). Reads the pool; no host synchronisation, and every
    allocation's shape follows from the arguments' shapes (CUDA-graph capturable)."""
    launches = decode_launches(out, query, pool, block_table, seq_lens, scale, requests=requests,
                               token_rows=token_rows, num_splits=num_splits)  # fmt: skip
    for launch in launches:
        launch.run()
