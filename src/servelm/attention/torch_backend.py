"""The reference attention backend: plain PyTorch (SDPA), runs on CPU, CUDA, anywhere.

`build_metadata` plans the step once; the layers only read the plan:

- Decodes (one new token per request) are attended together in one call, in place
  (requests are never reordered: the runner's sample rows follow scheduler order).
  On CPU in float32 the paged kernel of `servelm.kernels.cpu` reads K/V
  straight from the blocks (`KernelDecodes`); elsewhere, or without a compiler, they
  are gathered into one padded batch for SDPA (`GatherDecodes`). A lone decode with
  no kernel goes with the chunks (one SDPA call either way).
- Prefill chunks are attended one request at a time (their shapes differ): a chunk
  with nothing cached before it (a whole new prompt) attends to its own fresh K/V with
  SDPA's causal flag, skipping the pool and the mask; a chunk after cached context
  reads its context from the pool by precomputed slots and masks causally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from servelm.attention.backend import AttentionMetadata, CommonAttentionInputs, register_backend, slots_of
from servelm.kernels import cpu as cpu_kernels


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V at their pool slots. kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _pool_view(kv_cache: torch.Tensor, which: int) -> torch.Tensor:
    """K (0) or V (1) of the pool addressed by slot: [num_blocks * block_size, KVH, D]."""
    return kv_cache[which].view(-1, *kv_cache.shape[3:])


def _causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor | None:
    """Query i (at position num_keys - num_queries + i) sees keys 0..that position."""
    if num_queries == 1:
        return None
    offset = num_keys - num_queries
    rows = torch.arange(num_queries, device=device).unsqueeze(1) + offset
    cols = torch.arange(num_keys, device=device).unsqueeze(0)
    return cols <= rows  # [num_queries, num_keys] bool, True = attend


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """query: [q, H, D]; key/value: [k, KVH, D] → [q, H, D], causal with the query block at the end."""
    square = query.shape[0] == key.shape[0]  # no context before the queries: SDPA's own causal mask fits
    mask = None if square else _causal_mask(query.shape[0], key.shape[0], query.device)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
        key.transpose(0, 1).unsqueeze(0).to(query.dtype),  # [1, KVH, k, D]
        value.transpose(0, 1).unsqueeze(0).to(query.dtype),
        attn_mask=mask,
        is_causal=square and query.shape[0] > 1,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


class PagedDecodeKernel(Protocol):
    """The compiled CPU decode kernel's entry points (what `cpu_kernels.load()` returns)."""

    def prepare_decode(
        self,
        block_tables: torch.Tensor,  # [B, max_blocks] int32 contiguous
        seq_lens: torch.Tensor,  # [B] int32
        max_len: int,
    ) -> Any: ...  # a checked batch for decode_prepared, once per step

    def decode_prepared(
        self,
        query: torch.Tensor,  # [B, H, D] float32 contiguous
        k_pool: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 contiguous
        v_pool: torch.Tensor,
        batch: Any,
        scale: float,
    ) -> torch.Tensor: ...  # [B, H, D]


def _paged_kernel(device: torch.device, dtype: torch.dtype) -> PagedDecodeKernel | None:
    """The CPU decode kernel when it applies (float32 on CPU, and it could be built), else None."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return cpu_kernels.load()


# -- decode path ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelDecodes:
    """The step's decodes, attended by the CPU paged kernel straight from the blocks."""

    kernel: PagedDecodeKernel
    rows: torch.Tensor  # [B] long: each decode's token row in the flattened batch
    covers_batch: bool  # every token of the step is a decode (rows == 0..B-1)
    # The kernel's checked batch: block tables [B, ceil(max_seq_len / block_size)] int32 and
    # seq lens [B] int32 on CPU, prepared once here for every layer's call.
    batch: Any

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:  # [B, H, D]
        if not kv_cache.is_contiguous():
            raise ValueError("the CPU paged decode kernel needs a contiguous KV pool tensor")
        q = query.contiguous() if self.covers_batch else query.index_select(0, self.rows)
        return self.kernel.decode_prepared(q, kv_cache[0], kv_cache[1], self.batch, scale)


@dataclass(frozen=True)
class GatherDecodes:
    """The step's decodes, gathered from the pool into one padded batch for SDPA."""

    rows: torch.Tensor  # [B] long, on device: each decode's token row in the flattened batch
    covers_batch: bool  # every token of the step is a decode
    slots: torch.Tensor  # [B, max_seq_len] long, on device: pool slot per position, 0 past a request's length
    valid: torch.Tensor  # [B, 1, 1, max_seq_len] bool, on device: key mask, True = a real position

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:  # [B, H, D]
        k = _pool_view(kv_cache, 0)[self.slots].transpose(1, 2).to(query.dtype)  # [B, KVH, max_len, D]
        v = _pool_view(kv_cache, 1)[self.slots].transpose(1, 2).to(query.dtype)
        q = query[self.rows].unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.valid, scale=scale, enable_gqa=True)
        return out.squeeze(2)


def _build_decodes(common: CommonAttentionInputs, indices: torch.Tensor) -> KernelDecodes | GatherDecodes | None:
    """The decode plan for requests `indices` ([B] long, ascending), or None when they go with the chunks."""
    assert common.block_table is not None and indices.numel() > 0
    kernel = _paged_kernel(common.device, common.dtype)
    if kernel is None and indices.numel() == 1:
        return None  # a lone decode without the kernel: the chunk path is one SDPA call too
    rows = common.query_start_loc[indices].long()
    seq_lens = common.seq_lens[indices]  # [B] int32
    max_seq_len = int(seq_lens.max())
    covers_batch = indices.numel() == common.num_tokens
    bs = common.block_size
    if kernel is not None:
        # Only the blocks a request's seq_len reaches are read; the columns past them never are.
        width = (max_seq_len + bs - 1) // bs
        tables = common.block_table[indices, :width].contiguous()
        return KernelDecodes(
            kernel, rows, covers_batch, kernel.prepare_decode(tables, seq_lens.contiguous(), max_seq_len)
        )
    positions = torch.arange(max_seq_len)  # [max_len]
    valid = positions.unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, max_len]
    width = common.block_table.shape[1]
    clamped = positions.clamp(max=width * bs - 1)  # positions past every length index inside the table
    slots = slots_of(common.block_table, indices.unsqueeze(1), clamped.unsqueeze(0), bs).masked_fill(~valid, 0)
    device = common.device
    return GatherDecodes(
        rows=rows.to(device, non_blocking=True),
        covers_batch=covers_batch,
        slots=slots.to(device, non_blocking=True),
        valid=valid[:, None, None, :].to(device, non_blocking=True),
    )


# -- prefill path --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillChunk:
    """One request's chunk of new tokens, attended on its own."""

    start: int  # first token row of the chunk in the flattened batch
    end: int  # one past its last row
    # [seq_len] long, on device: pool slots of positions 0..seq_len-1 (context, then the chunk);
    # None when nothing is cached before the chunk and it attends to its own fresh K/V.
    context_slots: torch.Tensor | None

    def attend(self, query, key, value, kv_cache: torch.Tensor | None, scale: float) -> torch.Tensor:
        s, e = self.start, self.end
        if self.context_slots is None:
            return _attend(query[s:e], key[s:e], value[s:e], scale)
        assert kv_cache is not None  # TorchAttentionBackend.forward checked
        k = _pool_view(kv_cache, 0)[self.context_slots]  # [seq_len, KVH, D]
        v = _pool_view(kv_cache, 1)[self.context_slots]
        return _attend(query[s:e], k, v, scale)


def _build_chunks(common: CommonAttentionInputs, indices: list[int]) -> tuple[PrefillChunk, ...]:
    """Chunks of requests `indices`; the context slots of all of them reach the device in one copy."""
    starts = common.query_start_loc.tolist()
    seq_lens = common.seq_lens.tolist()
    with_context = [i for i in indices if seq_lens[i] > starts[i + 1] - starts[i]]
    if with_context and common.block_table is None:
        raise ValueError("a chunk after cached context needs a KV pool (block_table and slot_mapping)")
    context: dict[int, torch.Tensor] = {}
    if with_context:
        assert common.block_table is not None
        per_request = [
            slots_of(common.block_table, torch.tensor(i), torch.arange(seq_lens[i]), common.block_size)
            for i in with_context
        ]
        on_device = torch.cat(per_request).to(common.device, non_blocking=True)
        context = dict(zip(with_context, on_device.split([seq_lens[i] for i in with_context])))
    return tuple(PrefillChunk(starts[i], starts[i + 1], context.get(i)) for i in indices)


# -- the backend ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The torch backend's plan for one step, built once by `build_metadata`, read by every layer."""

    slot_mapping: torch.Tensor | None  # [T] long, on device: where new K/V are written; None without a pool
    decodes: KernelDecodes | GatherDecodes | None  # the step's decodes together, or None
    chunks: tuple[PrefillChunk, ...]  # every other request, in batch order

    @property
    def reads_kv_pool(self) -> bool:
        return self.decodes is not None or any(c.context_slots is not None for c in self.chunks)


class TorchAttentionBackend:
    name = "torch"

    def build_metadata(self, common: CommonAttentionInputs) -> TorchAttentionMetadata:
        """See `AttentionBackend.build_metadata`: once per step, pure."""
        decodes = None
        decode_indices = torch.nonzero(common.query_lens == 1).flatten()  # [B] long, ascending
        if common.has_kv_pool and decode_indices.numel():
            decodes = _build_decodes(common, decode_indices)
        in_decodes = set(decode_indices.tolist()) if decodes is not None else set()
        chunk_indices = [i for i in range(common.num_requests) if i not in in_decodes]
        return TorchAttentionMetadata(common.slot_mapping, decodes, _build_chunks(common, chunk_indices))

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        if not isinstance(metadata, TorchAttentionMetadata):
            raise TypeError(f"the torch backend needs TorchAttentionMetadata, got {type(metadata).__name__}")
        if kv_cache is not None:
            if metadata.slot_mapping is None:
                raise ValueError("a KV pool was given but the metadata was built without one (no slot_mapping)")
            write_kv(kv_cache, key, value, metadata.slot_mapping)
        elif metadata.reads_kv_pool:
            raise ValueError("the metadata reads K/V from the pool but no kv_cache was given")
        decodes = metadata.decodes
        if decodes is not None and decodes.covers_batch:
            assert kv_cache is not None
            return decodes.attend(query, kv_cache, scale)
        output = query.new_empty(query.shape)  # contiguous even when query is a strided view
        if decodes is not None:
            assert kv_cache is not None
            output[decodes.rows] = decodes.attend(query, kv_cache, scale)
        for chunk in metadata.chunks:
            output[chunk.start : chunk.end] = chunk.attend(query, key, value, kv_cache, scale)
        return output


register_backend("torch", TorchAttentionBackend)
