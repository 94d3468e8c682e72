"""Random GGUF blocks (Q4_0 / Q4_1 / Q8_0) for kernel and weight tests: every code byte drawn
uniformly, scales and offsets as random half-precision numbers, a few blocks made awkward."""

from __future__ import annotations

import numpy as np
import torch

from servelm.models.gguf_blocks import BLOCK, BlockType, BlockWeight


def random_block_weight(block_type: BlockType, rows: int, cols: int, generator: torch.Generator) -> BlockWeight:
    """[rows, cols] as random `block_type` blocks. Scales are ~N(0, 0.05) halves (some negative),
    offsets ~N(0, 0.5); where there is room, block 0 of row 0 has d = 0 and block 0 of row 1 a
    subnormal d, and Q8_0 codes include -128 (which ggml never writes but the format can hold)."""
    nb = cols // BLOCK
    if cols % BLOCK:
        raise ValueError(f"cols must be a multiple of {BLOCK}, got {cols}")
    blocks = torch.randint(0, 256, (rows, nb, block_type.block_bytes), dtype=torch.uint8, generator=generator)
    d = (torch.randn(rows, nb, generator=generator) * 0.05).half()
    if rows > 1 and nb:
        d[0, 0] = 0.0
        d[1, 0] = 3e-6  # a half subnormal (below 2**-14)
    blocks[:, :, 0:2] = d.view(torch.uint8).view(rows, nb, 2)
    if block_type is BlockType.Q4_1:
        m = (torch.randn(rows, nb, generator=generator) * 0.5).half()
        blocks[:, :, 2:4] = m.view(torch.uint8).view(rows, nb, 2)
    return BlockWeight(block_type, blocks)


def dequantize_float64(weight: BlockWeight) -> torch.Tensor:
    """The weight [N, K] in float64, straight from the format's definition in numpy (no code shared
    with `BlockWeight.dequantize`): Q4_0 d * (q - 8), Q4_1 fl32(d * q + m), Q8_0 d * q. Q4_1 rounds
    to float32 once, as the file's float32 weights are (d * q is exact; the + m is not)."""
    raw = weight.blocks.numpy()  # [N, K/32, bytes] uint8
    d = np.ascontiguousarray(raw[:, :, 0:2]).view("<f2").astype(np.float64)  # [N, K/32, 1]
    if weight.block_type is BlockType.Q8_0:
        w = d * np.ascontiguousarray(raw[:, :, 2:]).view(np.int8)
    else:
        packed = raw[:, :, weight.block_type.scales_bytes :]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)  # q[0..15], q[16..31]
        if weight.block_type is BlockType.Q4_0:
            w = d * (q - 8)
        else:
            m = np.ascontiguousarray(raw[:, :, 2:4]).view("<f2").astype(np.float64)
            w = (d * q + m).astype(np.float32).astype(np.float64)  # the one float32 rounding of a Q4_1 weight
    return torch.from_numpy(w.reshape(weight.shape[0], -1))
