"""How one layer's paged KV pool stores K/V: in the model's dtype, or quantized with scales.

    "auto"   a tensor [2, num_blocks, block_size, KVH, D] in the model's dtype (K then V); under
             latent attention (models/mla.py) one plane, [1, ...]: the latent is the key and the
             value both, so a V read reads the K plane and a write stores the key alone
    "int8"   QuantizedKV: int8 codes of that shape + float32 scales [2, num_blocks, block_size, KVH]
    "fp8"    QuantizedKV: float8_e4m3fn codes, same scales

Quantization is symmetric, one scale per (token, KV head): scale = absmax over head_dim / QMAX,
value ~= code * scale. A token's codes depend on nothing but its own K/V, so a block filled token
by token (decodes, chunks, a draft's guesses) never needs requantizing, and a block's bytes are its
slices of `data` and `scales` along dim 1 (the block id), which is all a KV mover copies.

Writes quantize (`write_kv`); reads dequantize into the compute dtype (`gather_kv`), except the
CPU paged decode kernel, which reads int8 codes and scales itself (servelm.kernels.cpu). Every
attention read sees the stored values, a fresh prompt's own K/V included (`write_kv` returns them),
so a token's output does not depend on whether its context was computed in its step or read from
the pool (a prefix hit, a resumed preemption, an earlier chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Largest code magnitude per quantized dtype: int8 keeps -128 unused (symmetric); 448 is e4m3fn's max.
QUANTIZED_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's K/V pool stored as 8-bit codes with a float32 scale per (token, KV head)."""

    data: torch.Tensor  # [2, num_blocks, block_size, KVH, D] int8 or float8_e4m3fn: K then V codes
    scales: torch.Tensor  # [2, num_blocks, block_size, KVH] float32: value = code * scale

    def __post_init__(self) -> None:
        if self.data.dtype not in QUANTIZED_MAX:
            raise ValueError(f"QuantizedKV data must be one of {list(QUANTIZED_MAX)}, got {self.data.dtype}")
        if self.scales.dtype != torch.float32 or self.scales.shape != self.data.shape[:-1]:
            raise ValueError(
                f"QuantizedKV scales must be float32 of shape {tuple(self.data.shape[:-1])} (data's without "
                f"head_dim), got {self.scales.dtype} {tuple(self.scales.shape)}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


# One layer's pool, as the runner allocates it and the backend reads and writes it.
LayerKVCache = torch.Tensor | QuantizedKV


def block_tensors(kv_caches: Sequence[LayerKVCache]) -> list[torch.Tensor]:
    """Every pool tensor whose dim 1 is the block id, layer by layer (codes before scales): a block's
    bytes are these tensors' [:, block_id] slices, in this order."""
    tensors: list[torch.Tensor] = []
    for kv_cache in kv_caches:
        tensors.extend((kv_cache.data, kv_cache.scales) if isinstance(kv_cache, QuantizedKV) else (kv_cache,))
    return tensors


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, KVH, D] → codes [N, KVH, D] of `dtype` and scales [N, KVH] float32, one per (token, head).

    |x - code * scale| <= scale / 2 for int8; <= |x| / 16 (3 mantissa bits) or 2^-10 * scale (e4m3's
    subnormals) for fp8. An all-zero head gets a tiny scale and zero codes."""
    qmax = QUANTIZED_MAX[dtype]
    x32 = x.float()
    scales = (x32.abs().amax(dim=-1) / qmax).clamp_min(torch.finfo(torch.float32).tiny)  # [N, KVH]
    scaled = (x32 / scales.unsqueeze(-1)).clamp(-qmax, qmax)
    codes = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes: [..., KVH, D], scales: [..., KVH] → values [..., KVH, D] in `dtype` (computed in float32)."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def write_kv(
    kv_cache: LayerKVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store new K/V ([T, KVH, D] each) at their pool slots ([T] long), quantizing for a QuantizedKV.

    Returns the K/V as a read of those slots would give them (in key's dtype): `key` and `value`
    themselves for a full-dtype pool, their dequantized codes for a quantized one."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    planes = (key,) if num_planes(kv_cache) == 1 else (key, value)  # one plane: the value is the key
    if not isinstance(kv_cache, QuantizedKV):
        for which, x in enumerate(planes):
            kv_cache[which].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x.to(kv_cache.dtype))
        return key, value
    stored = []
    for which, x in enumerate(planes):
        codes, scales = quantize(x, kv_cache.dtype)
        # As raw bytes: CPU torch has no index_copy_ for float8 (the bytes are the same either way).
        pool = kv_cache.data[which].view(-1, num_kv_heads, head_dim).view(torch.uint8)
        pool.index_copy_(0, slot_mapping, codes.view(torch.uint8))
        kv_cache.scales[which].view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales)
        stored.append(dequantize(codes, scales, x.dtype))
    return stored[0], stored[-1]


def num_planes(kv_cache: LayerKVCache) -> int:
    """2: K and V; 1: one latent plane read as both (latent attention)."""
    return int((kv_cache.data if isinstance(kv_cache, QuantizedKV) else kv_cache).shape[0])


def gather_kv(kv_cache: LayerKVCache, which: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (which=0) or V (1) at pool `slots` (any shape, long) → [*slots.shape, KVH, D] in `dtype`."""
    which = min(which, num_planes(kv_cache) - 1)
    if not isinstance(kv_cache, QuantizedKV):
        return kv_cache[which].view(-1, *kv_cache.shape[3:])[slots].to(dtype)
    codes = kv_cache.data[which].view(-1, *kv_cache.data.shape[3:])[slots]
    scales = kv_cache.scales[which].view(-1, kv_cache.scales.shape[3])[slots]
    return dequantize(codes, scales, dtype)


def gather_kv_blocks(kv_cache: LayerKVCache, which: int, block_ids: torch.Tensor, num_tokens: int,
                     dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """K (which=0) or V (1) of the first `num_tokens` positions of a request whose blocks, in order,
    are `block_ids` ([num_blocks] long) → [num_tokens, KVH, D] in `dtype`. What gather_kv reads at
    those positions' slots, copied a block at a time: a chunk's context on 2 CPU cores, 2,500 tokens
    of the default model's layer, 0.66 ms a layer by slot and 0.07 ms by block."""
    which = min(which, num_planes(kv_cache) - 1)
    if not isinstance(kv_cache, QuantizedKV):
        plane = kv_cache[which]
        return plane.index_select(0, block_ids).flatten(0, 1)[:num_tokens].to(dtype)
    # As raw bytes: CPU torch has no index_select for float8 (the bytes are the same either way).
    codes = kv_cache.data[which].view(torch.uint8).index_select(0, block_ids).view(kv_cache.dtype)
    scales = kv_cache.scales[which].index_select(0, block_ids)
    return dequantize(codes.flatten(0, 1)[:num_tokens], scales.flatten(0, 1)[:num_tokens], dtype)
