"""Paged prefill attention: a ragged batch of query chunks, each after its request's cached context,
causal within the chunk, GQA-aware.

    request r's tokens: rows query_start_loc[r] .. query_start_loc[r+1] of the batch (query_len q)
    its positions:      context .. seq_len - 1, context = seq_len - q (a prefix hit, earlier chunks)
    query i sees keys   0 .. context + i

Keys come from the pool through the block table: the backend writes the chunk's own K/V into the
pool before attending (as the torch backend does), so context and chunk are read the same way,
and a quantized pool's chunk attends to its stored (dequantized) values, as a later step reading
it from the pool would. Without a pool (a forward for prompt logits) the keys are the batch's fresh
K/V, addressed as a pool of block size 1 whose block id is the batch row (`fresh_kv`).

Grid (tiles, KVH, head chunks). The host cuts each request's chunk into tiles of BLOCK_Q queries
(`plan_tiles`: tile t is request tile_requests[t], queries tile_starts[t] .. + BLOCK_Q). A program
packs its tile's queries and a chunk of the query heads of one KV head into the M = BLOCK_Q x
HEADS_PER_PROG rows of one tile (row = query * HEADS_PER_PROG + head), so each K/V tile is read
once per KV head and head chunk. Keys before the tile's first query position need no mask; the
diagonal tiles after them are masked causally:

    keys:  0 ........ context + q_start | ... context + q_start + BLOCK_Q
           unmasked TILE steps          | masked (causal) TILE steps
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from servelm.kernels.triton.launch import KernelLaunch, dot_precision, pow2_at_least
from servelm.kernels.triton.online_softmax import attend_tile
from servelm.kernels.triton.pool import KVPool, load_kv_tiles, paged_locations

BLOCK_Q = 16  # queries per tile
PREFILL_TILE = 32  # keys per loop step
MAX_HEADS_PER_PROG = 8  # M = BLOCK_Q x heads stays <= 128 rows


@triton.jit
def _key_tiles(
    kv, kv_strides, table_row, first_row, positions, valid, kv_head, dims, head_dim,
    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, QUANTIZED: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """K and V ([TILE, DIM] each) of `positions` of one request: from its blocks, or (not PAGED) from
    batch rows first_row + position of the fresh K/V."""
    if PAGED:
        block_ids, offsets = paged_locations(table_row, positions, valid, BLOCK_SIZE)
    else:
        block_ids = (first_row + positions).to(tl.int64)
        offsets = tl.zeros_like(positions)
    return load_kv_tiles(kv, kv_strides, block_ids, offsets, kv_head, dims, valid, head_dim, QUANTIZED, OUT_DTYPE)


@triton.jit
def _attend_keys(
    q, q_positions, row_max, row_sum, acc, start, end, kv_end, kv, kv_strides, table_row, first_row, kv_head, dims,
    head_dim, qk_scale, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, QUANTIZED: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The running softmax (row_max, row_sum, acc) after keys [start, end), TILE at a time; keys
    past a row's position (and past kv_end) are masked when MASKED."""
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < kv_end
        k, v = _key_tiles(kv, kv_strides, table_row, first_row, positions, valid, kv_head, dims, head_dim, BLOCK_SIZE,
                          PAGED, QUANTIZED, q.dtype)  # fmt: skip
        visible = valid[None, :] & (positions[None, :] <= q_positions[:, None])
        row_max, row_sum, acc = attend_tile(q, k, v, visible, row_max, row_sum, acc, qk_scale, MASKED, DOT_PRECISION)
    return row_max, row_sum, acc


@triton.jit
def _prefill_kernel(
    out,  # [T, H, D]
    query,  # [T, H, D]
    kv,  # (K, V, K scales, V scales): KVPool.kernel_args
    block_table,  # [R, max_blocks] int32 (PAGED only)
    query_start_loc,  # [R + 1] int32
    seq_lens,  # [R] int32
    tile_requests,  # [tiles] int32
    tile_starts,  # [tiles] int32: first query of the tile within its request's chunk
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    kv_strides,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_PER_PROG: tl.constexpr,  # a power of two; GROUP is covered by cdiv(GROUP, it) programs
    BLOCK_Q: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    PAGED: tl.constexpr,
    QUANTIZED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    head_chunk = tl.program_id(2)
    request = tl.load(tile_requests + tile)
    q_start = tl.load(tile_starts + tile)
    first_row = tl.load(query_start_loc + request)
    query_len = tl.load(query_start_loc + request + 1) - first_row
    context = tl.load(seq_lens + request) - query_len

    rows = tl.arange(0, BLOCK_Q * HEADS_PER_PROG)
    query_index = q_start + rows // HEADS_PER_PROG  # [M] within the chunk
    group_index = head_chunk * HEADS_PER_PROG + rows % HEADS_PER_PROG  # [M] within the KV head's group
    row_ok = (query_index < query_len) & (group_index < GROUP)
    # Rows past the chunk repeat its last query (a finite softmax; never stored).
    query_index = tl.minimum(query_index, query_len - 1)
    heads = kv_head * GROUP + group_index
    dims = tl.arange(0, DIM)
    dim_ok = dims < head_dim
    token_rows = (first_row + query_index).to(tl.int64)
    q_mask = (group_index < GROUP)[:, None] & dim_ok[None, :]
    q = tl.load(query + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask,
                other=0.0)  # fmt: skip
    q_positions = context + query_index  # [M]

    row_max = tl.full([BLOCK_Q * HEADS_PER_PROG], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * HEADS_PER_PROG], tl.float32)
    acc = tl.zeros([BLOCK_Q * HEADS_PER_PROG, DIM], tl.float32)
    table_row = block_table + request.to(tl.int64) * stride_table
    diagonal = context + q_start  # every row of the tile sees every key before this
    unmasked_end = (diagonal // TILE) * TILE
    kv_end = context + tl.minimum(q_start + BLOCK_Q, query_len)  # one past the last key any row sees
    # fmt: off
    row_max, row_sum, acc = _attend_keys(q, q_positions, row_max, row_sum, acc, 0, unmasked_end, kv_end, kv,
                                         kv_strides, table_row, first_row, kv_head, dims, head_dim, qk_scale, TILE,
                                         BLOCK_SIZE, PAGED, QUANTIZED, False, DOT_PRECISION)
    row_max, row_sum, acc = _attend_keys(q, q_positions, row_max, row_sum, acc, unmasked_end, kv_end, kv_end, kv,
                                         kv_strides, table_row, first_row, kv_head, dims, head_dim, qk_scale, TILE,
                                         BLOCK_SIZE, PAGED, QUANTIZED, True, DOT_PRECISION)
    # fmt: on

    out_offsets = token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(
        out + out_offsets, (acc / row_sum[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
    )


def plan_tiles(query_lens: torch.Tensor, requests: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of BLOCK_Q queries over the chunks of `requests` ([R'] long, CPU: batch indices) whose
    query_lens ([R] int, CPU) are given: (tile_requests, tile_starts), [tiles] int32 each, CPU."""
    lens = query_lens[requests].long()
    tiles_per_request = (lens + BLOCK_Q - 1) // BLOCK_Q  # [R']
    tile_requests = torch.repeat_interleave(requests.long(), tiles_per_request)
    first_tile = torch.cumsum(tiles_per_request, 0) - tiles_per_request
    tile_index = torch.arange(tile_requests.numel()) - torch.repeat_interleave(first_tile, tiles_per_request)
    return tile_requests.to(torch.int32), (tile_index * BLOCK_Q).to(torch.int32)


def fresh_kv(key: torch.Tensor, value: torch.Tensor) -> KVPool:
    """The batch's new K/V ([T, KVH, D] each) as a pool of block size 1 whose block id is the batch
    row (the kernel's not-PAGED addressing). Copies them once so K and V share strides."""
    return KVPool(key.contiguous().unsqueeze(1), value.contiguous().unsqueeze(1))


def prefill_launch(
    out: torch.Tensor,  # [T, H, D]: the tiles' rows are written
    query: torch.Tensor,  # [T, H, D], head_dim contiguous
    kv: KVPool,  # the paged pool (chunks' K/V already written), or fresh_kv(...) with block_table None
    block_table: torch.Tensor | None,  # [R, max_blocks] int32 on device; None: kv is fresh, no context
    query_start_loc: torch.Tensor,  # [R + 1] int32 on device
    seq_lens: torch.Tensor,  # [R] int32 on device
    tile_requests: torch.Tensor,  # [tiles] int32 on device (plan_tiles)
    tile_starts: torch.Tensor,  # [tiles] int32 on device
    scale: float,
) -> KernelLaunch:
    num_heads, head_dim = query.shape[1], query.shape[2]
    if num_heads % kv.num_kv_heads or head_dim != kv.head_dim or query.stride(-1) != 1:
        raise ValueError(
            f"query {tuple(query.shape)} (stride {query.stride()}) does not fit K/V of {kv.num_kv_heads} heads "
            f"x {kv.head_dim} (heads a multiple of KV heads, head_dim equal and contiguous)"
        )
    group = num_heads // kv.num_kv_heads
    heads_per_prog = min(pow2_at_least(group), MAX_HEADS_PER_PROG)
    dim = pow2_at_least(head_dim)
    paged = block_table is not None
    args = {
        "out": out,
        "query": query,
        **kv.kernel_args(),
        "block_table": block_table if block_table is not None else seq_lens,  # unread unless PAGED
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "tile_requests": tile_requests,
        "tile_starts": tile_starts,
        "qk_scale": scale * math.log2(math.e),
        "stride_qt": query.stride(0),
        "stride_qh": query.stride(1),
        "stride_ot": out.stride(0),
        "stride_oh": out.stride(1),
        "stride_table": block_table.stride(0) if block_table is not None else 0,
        "head_dim": head_dim,
        "GROUP": group,
        "HEADS_PER_PROG": heads_per_prog,
        "BLOCK_Q": BLOCK_Q,
        "DIM": dim,
        "BLOCK_SIZE": kv.block_size if paged else 1,
        "TILE": PREFILL_TILE,
        "PAGED": paged,
        "DOT_PRECISION": dot_precision(query.dtype),
    }
    grid = (tile_requests.shape[0], kv.num_kv_heads, math.ceil(group / heads_per_prog))
    num_warps = 8 if BLOCK_Q * heads_per_prog * dim >= 128 * 128 else 4
    return KernelLaunch(_prefill_kernel, grid, args, num_warps=num_warps)


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv: KVPool,
    block_table: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_requests: torch.Tensor,
    tile_starts: torch.Tensor,
    scale: float,
) -> None:
    """Write the attention output of every tile's queries into their rows of `out` (see
    `prefill_launch`). Reads K/V only; rows of other requests are left as they are."""
    prefill_launch(out, query, kv, block_table, query_start_loc, seq_lens, tile_requests, tile_starts, scale).run()
