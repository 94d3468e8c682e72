"""Rotary position embedding applied in place, as one Triton kernel: Hugging Face's rotate-half layout.

    rotate_(x, cos, sin)   x: [T, N, D] (q and k heads side by side, any token/head strides, unit
                           stride along D); cos, sin: [T, 1, D/2] (RotaryEmbedding.cos_sin: each
                           token's angles, already in x's dtype) → x, rotated in place:

        x1, x2 = x[..., :D/2], x[..., D/2:]
        x1' = x1 * cos - x2 * sin
        x2' = x2 * cos + x1 * sin

The angles come from the model's own cos/sin (computed once per forward from its scaled inverse
frequencies, models/rotary.py), so every RoPE scaling it supports is already in them and nothing
is recomputed here. Each product is rounded to x's dtype before the sum, exactly as the torch
path (`apply_rotary`, four separate elementwise ops in the dtype) rounds it, and the launch turns
off multiply-add contraction, so the two agree bit for bit (on sm_90 the PTX is mul.rn, then
sub.rn / add.rn, in the dtype).

One program per (token, group of heads): x is read once and written once in place; the torch path
reads it twice and writes four half-size temporaries and the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, x_token_stride, x_head_stride,
    cos_ptr, cos_token_stride,
    sin_ptr, sin_token_stride,
    num_heads, half,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    cos = tl.load(cos_ptr + token * cos_token_stride + dims, mask=dim_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * sin_token_stride + dims, mask=dim_mask, other=0.0)[None, :]
    first = x_ptr + token * x_token_stride + heads[:, None].to(tl.int64) * x_head_stride + dims[None, :]
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    # Products rounded to the dtype first, then the sum: the torch path's roundings.
    x1_cos = (x1.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
    x2_sin = (x2.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32)
    x2_cos = (x2.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
    x1_sin = (x1.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(first, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first + half, (x2_cos + x1_sin).to(dtype), mask=mask)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, N, D] in place by cos, sin: [T, 1, D/2] (x's dtype); returns x."""
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, heads, head_dim] with an even head_dim; got {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    for name, angles in (("cos", cos), ("sin", sin)):
        if angles.shape != (num_tokens, 1, half):
            raise ValueError(f"{name} must be [{num_tokens}, 1, {half}]; got {tuple(angles.shape)}")
        if angles.dtype != x.dtype:
            raise ValueError(f"{name} is {angles.dtype}, x {x.dtype}: the angles come in x's dtype")
        if half > 1 and angles.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along head_dim")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride along head_dim")
    if num_tokens == 0 or num_heads == 0:
        return x
    block_half = triton.next_power_of_2(half)
    # About 2048 elements per half-tile per program: all heads of a token for common shapes.
    block_heads = min(triton.next_power_of_2(num_heads), max(2048 // block_half, 1))
    grid = (num_tokens, triton.cdiv(num_heads, block_heads))
    _rotary_kernel[grid](
        x, x.stride(0), x.stride(1), cos, cos.stride(0), sin, sin.stride(0), num_heads, half,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, num_warps=4,
        # No multiply-add contraction: it would skip the rounding of one product (fma.rn.bf16 on
        # sm_90), where torch rounds both; memory-bound, the kernel loses nothing by it.
        enable_fp_fusion=False,
    )  # fmt: skip
    return x
