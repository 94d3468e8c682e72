"""KV pool tensors: what the pool stores, how many blocks a memory budget buys, allocating them once.

Per layer one tensor [2, num_blocks, block_size, num_kv_heads, head_dim] in the model's dtype: K then
V, addressed by block id exactly as the block pool in servelm.kv hands them out. With
--kv-cache-dtype int8 or fp8 a layer's pool is a QuantizedKV instead (8-bit codes of that shape plus
float32 scales [2, num_blocks, block_size, num_kv_heads]; see servelm.attention.kv_storage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelm.attention.kv_storage import QUANTIZED_MAX, LayerKVCache, QuantizedKV
from servelm.models.arch import ModelArchConfig
from servelm.worker.host_residency import zeros_on_small_pages

# CacheConfig.kv_cache_dtype's quantized names → what the pool stores.
_QUANTIZED_KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a pool stores K/V as for CacheConfig.kv_cache_dtype: "auto" → the model's dtype.

    Called once by the engine builder. Raises ValueError for an unknown name, and for "fp8" on a
    device where torch cannot store and read back float8_e4m3fn (naming the device; int8 works anywhere).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _QUANTIZED_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of auto, {', '.join(_QUANTIZED_KV_DTYPES)}; got {kv_cache_dtype!r}"
        )
    dtype = _QUANTIZED_KV_DTYPES[kv_cache_dtype]
    if dtype == torch.float8_e4m3fn:
        _check_fp8_storage(device)
    return dtype


def _check_fp8_storage(device: torch.device) -> None:
    """The pool's fp8 operations (cast, byte-wise slot writes, gather, dequantize) on a tiny tensor."""
    try:
        codes = torch.full((2, 1, 1), 1.5, device=device).to(torch.float8_e4m3fn)
        pool = torch.zeros((4, 1, 1), dtype=torch.float8_e4m3fn, device=device)
        pool.view(torch.uint8).index_copy_(0, torch.tensor([0, 2], device=device), codes.view(torch.uint8))
        works = bool((pool[torch.tensor([2], device=device)].float() == 1.5).all())
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        works, reason = False, f": {exc}"
    else:
        reason = ": a stored value did not read back"
    if not works:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        raise ValueError(
            f"--kv-cache-dtype fp8: torch cannot store float8_e4m3fn KV on {device} ({name}){reason}; "
            "use --kv-cache-dtype int8"
        )


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes one block id takes in a pool of `dtype` (a quantized one counts its float32 scales).
    `num_kv_heads`: the KV heads this rank stores (models.sharding.local_num_kv_heads under tensor
    parallelism); None: all of the model's."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_head = arch.kv_cache_head_dim * element_size + (4 if dtype in QUANTIZED_MAX else 0)  # codes + a scale
    kv_heads = arch.kv_cache_heads if num_kv_heads is None else num_kv_heads
    per_token = arch.kv_planes * kv_heads * per_head  # K and V (a latent: one plane)
    return per_token * block_size * arch.num_hidden_layers


def num_blocks_for_budget(
    archs: Sequence[ModelArchConfig], block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """Blocks `budget_bytes` holds when each block id holds the K/V of every model in `archs` (the
    target's, and a draft model's own pool addressed by the same block ids), stored as `dtype`."""
    return blocks_in_budget(sum(bytes_per_block(arch, block_size, dtype) for arch in archs), budget_bytes)


def blocks_in_budget(block_bytes: int, budget_bytes: int) -> int:
    """Blocks of `block_bytes` that `budget_bytes` holds; ValueError when not even one."""
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no block of "
            f"{block_bytes / 2**20:.2f} MiB; raise --kv-cache-memory"
        )
    return int(num_blocks)


@dataclass(frozen=True)
class DeviceMemoryProfile:
    """What an accelerator's KV pool is sized from, in bytes; measured once the weights are loaded,
    around one worst-case step (worker/memory_profile.py)."""

    total: int  # the device's memory
    # Allocated by torch before the step: the weights (a draft model's too; and whatever else this
    # process already holds on the device, e.g. another engine's pool in a test).
    weights: int
    peak_activation: int  # the most the profiled step allocated on top of `weights`
    # Used on the device outside torch's allocator: the CUDA context, cuBLAS/NCCL workspaces, and
    # any other process on the same device (it counts against the utilization too: conservative).
    non_torch: int
    profiled_tokens: int  # the step's tokens (max_num_batched_tokens), for the error message


# Device memory held back for what the profile does not see: CUDA graphs' private pools (decode
# graphs keep their activations and outputs per captured batch size; vLLM measures ~0.5-1 GiB for
# 7B-class models) and allocator fragmentation. A stated estimate, not a measurement.
DEVICE_MEMORY_RESERVE_BYTES = 1 << 29  # 512 MiB


def kv_blocks_for_device(
    profile: DeviceMemoryProfile,
    utilization: float,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    reserve: int = DEVICE_MEMORY_RESERVE_BYTES,
) -> int:
    """Blocks of `block_bytes` (each `block_size` tokens) for the KV pool on an accelerator, as
    vLLM's --gpu-memory-utilization sizes it:

        KV bytes = total x utilization - (weights + peak activation + non-torch + reserve)

    Raises InsufficientKVMemoryError, naming every term and what to change, when that holds fewer
    blocks than one request of `max_model_len` tokens needs."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    allowed = int(profile.total * utilization)
    left = allowed - (profile.weights + profile.peak_activation + profile.non_torch + reserve)
    num_blocks = max(left, 0) // block_bytes
    min_blocks = -(-max_model_len // block_size)
    if num_blocks < min_blocks:
        raise InsufficientKVMemoryError(_too_little_memory(
            profile, utilization, reserve, left, block_bytes, min_blocks, max_model_len, num_blocks * block_size
        ))  # fmt: skip
    return int(num_blocks)


class InsufficientKVMemoryError(ValueError):
    """The device has too little memory left for the KV of one request of max_model_len tokens."""


def _too_little_memory(profile: DeviceMemoryProfile, utilization: float, reserve: int, left: int, block_bytes: int,
                       min_blocks: int, max_model_len: int, tokens_that_fit: int) -> str:  # fmt: skip
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    shorter = f"--max-model-len (to {tokens_that_fit} at most) or " if tokens_that_fit > 0 else ""
    return (
        f"not enough device memory for the KV cache of one request of max_model_len {max_model_len} tokens "
        f"({min_blocks} blocks of {block_bytes / 2**20:.2f} MiB = {gib(min_blocks * block_bytes)}): of "
        f"{gib(profile.total)} x --gpu-memory-utilization {utilization} = {gib(int(profile.total * utilization))}, "
        f"the weights take {gib(profile.weights)}, the peak activation of a {profile.profiled_tokens}-token step "
        f"{gib(profile.peak_activation)}, memory outside torch (CUDA context, libraries, other processes) "
        f"{gib(profile.non_torch)} and the reserve for CUDA graphs {gib(reserve)}, leaving {gib(left)} for KV. "
        f"Raise --gpu-memory-utilization, lower {shorter}--max-num-batched-tokens, or store KV as --kv-cache-dtype int8"
    )


def allocate_kv_caches(
    arch: ModelArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int | None = None,
    padding_block: bool = False,
) -> list[LayerKVCache]:
    """One zeroed pool per layer storing `dtype`: a plain tensor, or a QuantizedKV for int8 / fp8.
    `num_kv_heads`: the KV heads this rank stores (local_num_kv_heads); None: all of the model's.
    `padding_block`: one block more, id `num_blocks`, that the scheduler (whose pool has `num_blocks`)
    never hands out: the decode graphs' padding rows write their K/V there (worker/cuda_graphs.py)."""
    kv_heads = arch.kv_cache_heads if num_kv_heads is None else num_kv_heads
    shape = (arch.kv_planes, num_blocks + int(padding_block), block_size, kv_heads, arch.kv_cache_head_dim)
    if dtype not in QUANTIZED_MAX:
        return [zeros_on_small_pages(shape, dtype, device) for _ in range(arch.num_hidden_layers)]
    return [
        QuantizedKV(zeros_on_small_pages(shape, dtype, device), zeros_on_small_pages(shape[:-1], torch.float32, device))
        for _ in range(arch.num_hidden_layers)
    ]
