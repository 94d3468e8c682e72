"""Block-quantised weights kept as the GGUF file stores them: Q4_0, Q4_1 and Q8_0 blocks.

Every block holds 32 consecutive inputs of a row n: a half-precision scale d (Q4_1: and an
offset m), then the codes q. A Q4 block's byte i holds q[i] in its low nibble and q[i + 16] in
its high one; a Q8_0 block has one int8 per code:

    Q4_0 (18 bytes):  w = d * (q - 8),  q in 0..15      Q4_1 (20 bytes):  w = fl(d * q + m),  q in 0..15
    Q8_0 (34 bytes):  w = d * q,        q in -127..127

d * q (and d * (q - 8)) is exact in float32 (11 significant bits times at most 8), so Q4_1's + m
is the one rounding. A block is 0.5625 (Q4_0), 0.625 (Q4_1) or 1.0625 (Q8_0) bytes per weight
against float32's 4, which is what a decode step of a few requests pays for (a matrix-vector
product reads weights, it hardly computes). `BlockWeight.dequantize` rebuilds the float32 weight
with exactly gguf's roundings, bit for bit what `gguf.quants.dequantize` returns for the same blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, for every type here


class BlockType(enum.Enum):
    """A GGUF block type kept as blocks; the value is ggml's type id (what the C kernel is told)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8

    @property
    def block_bytes(self) -> int:
        return _BLOCK_BYTES[self]

    @property
    def scales_bytes(self) -> int:
        """The header before the codes: d (and Q4_1's m), two bytes each."""
        return 4 if self is BlockType.Q4_1 else 2


_BLOCK_BYTES = {BlockType.Q4_0: 18, BlockType.Q4_1: 20, BlockType.Q8_0: 34}


@dataclass(frozen=True)
class BlockWeight:
    """One [N, K] weight as GGUF blocks, rows in torch's [out, in] order."""

    block_type: BlockType
    blocks: torch.Tensor  # [N, K / 32, block_bytes] uint8: row n's blocks in input order, as in the file

    def __post_init__(self) -> None:
        if (
            self.blocks.dtype != torch.uint8
            or self.blocks.dim() != 3
            or self.blocks.shape[2] != self.block_type.block_bytes
        ):
            raise ValueError(
                f"{self.block_type.name} blocks must be uint8 [N, K / {BLOCK}, {self.block_type.block_bytes}], "
                f"got {self.blocks.dtype} {tuple(self.blocks.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        """The dense weight's shape, [N, K] (what shape validation compares)."""
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] * BLOCK))

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [N, K], rounded as gguf and the kernel round it.

        `out`: a float32 [N, K] tensor (e.g. rows of a layer's weight) to write into instead of a new one.
        """
        n, k = self.shape
        w = torch.empty(n, k) if out is None else out
        blocks = w.view(n, k // BLOCK, BLOCK)  # [N, K/32, 32]
        header = self.block_type.scales_bytes
        codes = self.blocks[:, :, header:]  # [N, K/32, 16 or 32] uint8
        if self.block_type is BlockType.Q8_0:
            blocks.copy_(codes.view(torch.int8))  # int8 -> float32, exact
        else:
            low, high = codes & 0x0F, codes >> 4  # q[0..15], q[16..31]
            blocks[:, :, :16].copy_(low)
            blocks[:, :, 16:].copy_(high)
            if self.block_type is BlockType.Q4_0:
                blocks.sub_(8.0)  # q - 8, exact
        blocks.mul_(self._halves(0))  # d * q: exact
        if self.block_type is BlockType.Q4_1:
            blocks.add_(self._halves(2))  # + m: the one rounding
        return w

    def _halves(self, offset: int) -> torch.Tensor:
        """The f16 at byte `offset` of every block, as float32 [N, K/32, 1]."""
        return self.blocks[:, :, offset : offset + 2].contiguous().view(torch.float16).float()

    def sliced(self, rows: range | None = None, columns: range | None = None) -> BlockWeight:
        """The rows and columns of a tensor-parallel shard, as blocks still (a contiguous copy of that
        part only). Columns must start and end on a block (ValueError otherwise: dequantize first)."""
        blocks = self.blocks
        if rows is not None:
            blocks = blocks[rows.start : rows.stop]
        if columns is not None:
            if columns.start % BLOCK or columns.stop % BLOCK:
                raise ValueError(
                    f"columns {columns.start}..{columns.stop} cut blocks of {BLOCK}: not representable as blocks"
                )
            blocks = blocks[:, columns.start // BLOCK : columns.stop // BLOCK]
        return BlockWeight(self.block_type, blocks.contiguous())
