"""x @ W^T with W kept as FP8 e4m3 codes and one float32 scale per block (models/fp8_blocks.py).

    out[m, n] = sum_k x[m, k] * dtype(float32(q[n, k]) * s[n // block_n, k // block_k])

Each program computes a BLOCK_M x BLOCK_N tile of the output and walks K in BLOCK_K steps. A tile
never straddles two scale blocks (BLOCK_N divides block_n, BLOCK_K divides block_k), so each step
dequantizes its weight tile with one scale, by the published formula and rounded to x's dtype:
the very weights the CPU path stores after dequantizing at load, so both paths multiply by the same
matrix and differ only in summation order. Accumulation is float32. The weight is read as one byte
per element: what decode, which reads every weight once a step, pays for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.triton.launch import KernelLaunch, dot_precision


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, x_row_stride,
    codes_ptr, codes_row_stride,
    scales_ptr, scales_row_stride,
    out_ptr, out_row_stride,
    M, N, K,
    SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    scale_row = (pid_n * BLOCK_N) // SCALE_BLOCK_N  # one scale row for the whole tile (BLOCK_N | block_n)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)  # fmt: skip
        codes = tl.load(codes_ptr + cols[:, None].to(tl.int64) * codes_row_stride + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)  # fmt: skip
        scale = tl.load(scales_ptr + scale_row * scales_row_stride + k0 // SCALE_BLOCK_K)
        weight = (codes.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(weight), input_precision=DOT_PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip


def _tile(limit: int, block: int) -> int:
    """The largest power of two <= limit that divides the scale block (so a tile has one scale)."""
    tile = limit
    while tile > 16 and block % tile:
        tile //= 2
    if block % tile:
        raise ValueError(f"FP8 scale block {block} has no tile of 16 or more dividing it")
    return tile


def fp8_block_gemm_launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int,
                          out: torch.Tensor) -> KernelLaunch:  # fmt: skip
    """The launch computing out = x @ dequant(codes, scales)^T; x [M, K], codes [N, K] fp8, scales
    [ceil(N / block_n), ceil(K / block_k)] float32, out [M, N] in x's dtype; unit stride along K and N."""
    m, k = x.shape
    n = codes.shape[0]
    block_m = 16 if m <= 16 else 64
    tile_n, tile_k = _tile(64, block_n), _tile(64, block_k)
    return KernelLaunch(
        _fp8_block_gemm_kernel,
        (triton.cdiv(m, block_m), triton.cdiv(n, tile_n)),
        dict(x_ptr=x, x_row_stride=x.stride(0), codes_ptr=codes, codes_row_stride=codes.stride(0),
             scales_ptr=scales, scales_row_stride=scales.stride(0), out_ptr=out, out_row_stride=out.stride(0),
             M=m, N=n, K=k, SCALE_BLOCK_N=block_n, SCALE_BLOCK_K=block_k, BLOCK_M=block_m, BLOCK_N=tile_n,
             BLOCK_K=tile_k, DOT_PRECISION=dot_precision(x.dtype)),
    )  # fmt: skip


def fp8_block_gemm(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int
) -> torch.Tensor:
    """x [M, K] (float32 / bfloat16 / float16) @ W^T, W [N, K] given as FP8 codes and block scales → [M, N] in x's dtype."""
    if codes.dtype != torch.float8_e4m3fn or x.shape[1] != codes.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} against FP8 codes {tuple(codes.shape)} {codes.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], codes.shape[0], dtype=x.dtype, device=x.device)
    fp8_block_gemm_launch(x, codes, scales, block_n, block_k, out).run()
    return out
