"""Lossless int8 storage for float32 weights that came from a block-quantised checkpoint.

A decode step of a few requests is a matrix-vector product: its cost is reading the
weights (540 MB in float32 for SmolLM2-135M), not the arithmetic. The default model ships
as GGUF Q4_1 / Q8_0, so its float32 weights hold little information: every block of 32
consecutive inputs of a row is

    Q4_1:  w = fl(fl(d * q) + m),  q in 0..15       Q8_0:  w = fl(d * q),  q in -127..127

with d (and m) half-precision numbers. `find_codes` recovers (q, d, m) from the float32
tensor alone and keeps them only if rebuilding gives back every weight bit for bit; then
`CompactWeight.matmul` (the `qgemm_small` CPU kernel) multiplies by the very same float32
weights while reading int8 codes plus two floats per 32 weights: under a third of the
bytes. Only the summation order differs from the float32 matmul (as it does between any
two BLAS kernels). Weights that are not of this form (random test models, fp16/bf16
checkpoints) simply keep the float32 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.kernels import cpu as cpu_kernels

BLOCK = 32
# Above this many rows a matmul is compute-bound and MKL's blocked float32 GEMM wins.
MAX_ROWS = 8


@dataclass
class CompactWeight:
    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / 32] float32
    mins: torch.Tensor | None  # [N, K / 32] float32 (Q4_1), None for Q8_0 (no offset)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, [N, K], rounded exactly as the kernel rounds it."""
        n, k = self.codes.shape
        w = self.scales.repeat_interleave(BLOCK, dim=1) * self.codes.float()
        if self.mins is not None:
            w = w + self.mins.repeat_interleave(BLOCK, dim=1)
        return w.view(n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T for x [M <= MAX_ROWS, K] float32 on CPU; None when the kernel is unavailable."""
        kernels = cpu_kernels.load()
        if kernels is None:
            return None
        return kernels.qgemm_small(x.contiguous(), self.codes, self.scales, self.mins)


def _solve(blocks: torch.Tensor, with_min: bool) -> CompactWeight | None:
    """Codes for blocks [N, nb, 32] under one scheme, or None if some block does not rebuild exactly.

    The scale is (max - min) / 15 (Q4_1; the min itself has code 0, so m = min exactly) or
    amax / 127 (Q8_0), rounded to half precision; the few blocks where that rounding lands
    one half-ulp off are retried with the neighbours.
    """
    n, nb, _ = blocks.shape
    flat = blocks.reshape(n * nb, BLOCK)
    if with_min:
        offset = flat.amin(-1)
        guess = (flat.amax(-1) - offset) / 15
    else:
        offset, guess = None, flat.abs().amax(-1) / 127
    codes = torch.empty(flat.shape, dtype=torch.int8)
    scales = torch.empty(n * nb)
    todo: torch.Tensor | None = None  # rows still unsolved; None: all of them (no copy on the first pass)
    for step in (0, -1, 1):
        x = flat if todo is None else flat[todo]
        lo = None if offset is None else (offset if todo is None else offset[todo]).unsqueeze(-1)
        g = guess if todo is None else guess[todo]
        d = (g.to(torch.float16).view(torch.int16) + step).view(torch.float16).float().unsqueeze(-1)
        q = torch.round((x if lo is None else x - lo) / torch.where(d == 0, 1.0, d))
        q = torch.where(d == 0, 0.0, q.clamp(0 if with_min else -127, 15 if with_min else 127))
        rebuilt = d * q if lo is None else d * q + lo
        ok = (rebuilt == x).all(-1)
        if todo is None:
            codes.copy_(q.to(torch.int8))  # rows that failed are overwritten by a later pass
            scales.copy_(d.squeeze(-1))
            todo = torch.nonzero(~ok).squeeze(-1)
        else:
            codes[todo[ok]] = q[ok].to(torch.int8)
            scales[todo[ok]] = d[ok].squeeze(-1)
            todo = todo[~ok]
        if todo.numel() == 0:
            mins = None if offset is None else offset.view(n, nb)
            return CompactWeight(codes.view(n, nb * BLOCK), scales.view(n, nb), mins)
    return None


def find_codes(weight: torch.Tensor) -> CompactWeight | None:
    """Recover block-quantised codes from a float32 [N, K] weight, verified bit for bit; else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
    for with_min in (True, False):
        # A cheap look at the first rows rejects ordinary float weights before the full pass.
        if _solve(blocks[:4], with_min) is None:
            continue
        compact = _solve(blocks, with_min)  # every block verified: dequantize() == weight bit for bit
        if compact is not None:
            return compact
    return None
