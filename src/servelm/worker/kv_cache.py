"""KV pool tensors: how many blocks a memory budget buys, and allocating them once.

Per layer one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]: K then V,
addressed by block id exactly as the block pool in servelm.kv hands them out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelm.models.arch import ModelArchConfig


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * arch.num_key_value_heads * arch.head_dim * element_size  # K and V
    return per_token * block_size * arch.num_hidden_layers


def num_blocks_for_budget(
    archs: Sequence[ModelArchConfig], block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """Blocks `budget_bytes` holds when each block id holds the K/V of every model in `archs` (the
    target's, and a draft model's own pool addressed by the same block ids)."""
    block_bytes = sum(bytes_per_block(arch, block_size, dtype) for arch in archs)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no block of "
            f"{block_bytes / 2**20:.2f} MiB; raise --kv-cache-memory"
        )
    return int(num_blocks)


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on an accelerator, or None where the notion does not apply (CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def allocate_kv_caches(
    arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]
