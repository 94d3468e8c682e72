"""Merge attention computed over disjoint key ranges (flash-decoding's splits) by log-sum-exp.

Split s of a (row, head) produced o_s (normalized over its keys) and lse_s = log2 sum exp2(scores)
over them (-inf for no keys). Over all keys the output is sum_s w_s o_s / sum_s w_s with
w_s = exp2(lse_s - max lse): exactly softmax over the union, since each o_s is its split's
softmax-weighted mean and w_s its share of the total weight. Split 0 always has keys (a context
is never empty), so the max is finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.triton.launch import KernelLaunch


@triton.jit
def _merge_kernel(
    out,  # [T, H, D]
    part_out,  # [rows, H, NUM_SPLITS, DIM] float32
    part_lse,  # [rows, H, NUM_SPLITS] float32
    token_rows,  # [rows] int32 (INDEXED only)
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    DIM: tl.constexpr,
    INDEXED: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    if INDEXED:
        token = tl.load(token_rows + row)
    else:
        token = row
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM)
    base = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits  # [NUM_SPLITS]
    lse = tl.load(part_lse + base)
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # an empty split: exp2(-inf) = 0
    parts = tl.load(part_out + base[:, None] * DIM + dims[None, :])  # [NUM_SPLITS, DIM]
    merged = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    out_offsets = token.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(out + out_offsets, merged.to(out.dtype.element_ty), mask=dims < head_dim)


def merge_splits_launch(
    out: torch.Tensor,  # [T, H, D]: each row's merged output goes to its token's row
    part_out: torch.Tensor,  # [rows, H, splits, DIM] float32
    part_lse: torch.Tensor,  # [rows, H, splits] float32
    token_rows: torch.Tensor | None,  # [rows] int32: token of each row; None: row i is token i
    head_dim: int,
) -> KernelLaunch:
    num_rows, num_heads, num_splits, dim = part_out.shape
    args = {
        "out": out,
        "part_out": part_out,
        "part_lse": part_lse,
        "token_rows": token_rows if token_rows is not None else part_lse,  # unread unless INDEXED
        "stride_ot": out.stride(0),
        "stride_oh": out.stride(1),
        "num_heads": num_heads,
        "head_dim": head_dim,
        "NUM_SPLITS": num_splits,
        "DIM": dim,
        "INDEXED": token_rows is not None,
    }
    return KernelLaunch(_merge_kernel, (num_rows, num_heads), args, num_warps=1 if dim <= 128 else 4)
