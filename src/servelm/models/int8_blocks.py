"""Block-quantised weights kept as int8 codes: what a GGUF Q4_1 / Q8_0 tensor holds.

Every block of 32 consecutive inputs of a row n is stored as codes q plus one scale d
(and, for Q4_1, one offset m), d and m half-precision numbers:

    Q4_1:  w = fl(fl(d * q) + m),  q in 0..15       Q8_0:  w = fl(d * q),  q in -127..127

The codes are under a third of the float32 weight's bytes, which is what a decode step of
a few requests pays for (it is a matrix-vector product: reading weights, not arithmetic).
`Int8BlockWeight.dequantize` rebuilds the float32 weight with exactly those roundings, so it
is bit for bit what `gguf.quants.dequantize` returns for the same blocks.

A Q8_0 block is also a Q4_1-form block with m = -0.0: fl(x + (-0.0)) == x for every float x
(the sign of a zero included), which is how a fused layer mixes Q4_1 and Q8_0 parts exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class Int8BlockWeight:
    """One [N, K] weight as codes and per-block scales (and offsets), rows in torch's [out, in] order."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / 32] float32
    mins: torch.Tensor | None  # [N, K / 32] float32 (Q4_1), None for Q8_0 (no offset)

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.codes.dtype != torch.int8 or k % BLOCK:
            raise ValueError(f"codes must be int8 with a multiple of {BLOCK} columns, got {self.codes.dtype} {(n, k)}")
        for name, part in (("scales", self.scales), ("mins", self.mins)):
            if part is not None and (part.dtype != torch.float32 or tuple(part.shape) != (n, k // BLOCK)):
                raise ValueError(f"{name} must be float32 of shape {(n, k // BLOCK)}, got {part.dtype} {tuple(part.shape)}")

    @property
    def shape(self) -> torch.Size:
        """The dense weight's shape, [N, K] (what shape validation compares)."""
        return self.codes.shape

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [N, K]: fl(fl(d * q) + m) per element, as gguf and the kernel round it.

        `out`: a float32 [N, K] tensor (e.g. rows of a layer's weight) to write into instead of a new one.
        """
        n, k = self.codes.shape
        w = torch.empty(n, k) if out is None else out
        blocks = w.view(n, k // BLOCK, BLOCK)  # [N, K/32, 32]
        blocks.copy_(self.codes.view(n, k // BLOCK, BLOCK))  # int8 -> float32, exact
        blocks.mul_(self.scales.unsqueeze(-1))
        if self.mins is not None:
            blocks.add_(self.mins.unsqueeze(-1))
        return w

    def sliced(self, rows: range | None = None, columns: range | None = None) -> Int8BlockWeight:
        """The rows and columns of a tensor-parallel shard, as codes still (a contiguous copy of that
        part only). Columns must start and end on a block (ValueError otherwise: dequantize first)."""
        codes, scales, mins = self.codes, self.scales, self.mins
        if rows is not None:
            codes, scales = codes[rows.start : rows.stop], scales[rows.start : rows.stop]
            mins = None if mins is None else mins[rows.start : rows.stop]
        if columns is not None:
            if columns.start % BLOCK or columns.stop % BLOCK:
                raise ValueError(f"columns {columns.start}..{columns.stop} cut blocks of {BLOCK}: not representable as codes")
            blocks = slice(columns.start // BLOCK, columns.stop // BLOCK)
            codes, scales = codes[:, columns.start : columns.stop], scales[:, blocks]
            mins = None if mins is None else mins[:, blocks]
        return Int8BlockWeight(
            codes.contiguous(), scales.contiguous(), None if mins is None else mins.contiguous()
        )
