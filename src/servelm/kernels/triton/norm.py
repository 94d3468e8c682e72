"""RMSNorm, alone or fused with the residual add before it, as one Triton kernel over each row.

    rms_norm(x, weight, eps)                   -> weight * rmsnorm(x)
    add_rms_norm(x, residual, weight, eps)     -> (weight * rmsnorm(x + residual), x + residual)

The numerics are the model's torch math (`torch_rms_norm` in models/fused_ops.py), step for step,
so that only the order of the sum of squares differs:

    s    = (x + residual)            in float32, rounded to the dtype (torch's add does the same);
                                     written out as the new residual, and the norm reads it rounded
    n    = s32 * rsqrt(mean(s32^2) + eps)      float32 whatever the dtype
    out  = weight * n.to(x.dtype)    the product in float32, rounded to promote(x, weight) dtype

One program per row (token): the row is read once, the sum of squares reduced in registers, and
each output written once; unfused that is five to seven kernels and as many passes over the row.
Both functions are out of place (new tensors); inputs may have any row stride, with unit stride
along the hidden dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536  # one row lives in one program's registers


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_row_stride,
    residual_ptr, residual_row_stride,
    weight_ptr,
    out_ptr, out_row_stride,
    sum_ptr, sum_row_stride,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # int64: T * stride may exceed 2^31 for long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # The sum rounded to the dtype, as the unfused add stores it; the norm reads that value.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_row_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden  # masked lanes are 0 and add nothing
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]; weight: [hidden] → weight * rmsnorm(x), [T, hidden] in promote(x, weight) dtype."""
    out = _empty_out(x, weight)
    _launch(x, None, weight, out, None, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, hidden] of one dtype; weight: [hidden] →
    (weight * rmsnorm(x + residual), x + residual), the sum in x's dtype."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    out = _empty_out(x, weight)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, out, total, eps)
    return out, total


def _empty_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
            total: torch.Tensor | None, eps: float) -> None:  # fmt: skip
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, hidden] and weight [hidden]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    hidden = x.shape[1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is over the kernel's {MAX_HIDDEN}")
    for name, tensor in (("x", x), ("residual", residual), ("weight", weight)):
        if tensor is not None and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along the hidden dimension")
    if x.shape[0] == 0:
        return
    block = triton.next_power_of_2(hidden)
    # Enough warps that each thread holds a few elements of the row, not hundreds.
    num_warps = min(max(block // 512, 1), 16)
    residual_arg = x if residual is None else residual  # never read without HAS_RESIDUAL
    total_arg = out if total is None else total  # never written without HAS_RESIDUAL
    _rms_norm_kernel[(x.shape[0],)](
        x, x.stride(0), residual_arg, residual_arg.stride(0), weight, out, out.stride(0),
        total_arg, total_arg.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
