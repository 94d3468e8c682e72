"""The Triton attention backend: paged decode and prefill kernels (servelm.kernels.triton) for CUDA;
on CPU they run under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check them.

`build_metadata` plans a step once, and moves every small per-request array the kernels read to
the device in one copy:

- Decodes (a request with one new token, over a KV pool) are rows of the paged decode kernel, in
  batch order; each row writes its own token's output row, so decodes and chunks stay mixed in
  scheduler order and nothing is reordered.
- Every other request (a prompt chunk, a chunk after cached context, speculative verification's
  few tokens) goes to the prefill kernel, cut into tiles of queries on the host.

`forward` writes the step's new K/V into the pool first (quantized for an int8 / fp8 pool), then
runs the decode kernel and the prefill kernel, each filling its rows of one output: a chunk reads
its own keys from the pool like its context (see prefill_attention.py for why).

It is also a `DecodeGraphBackend` with `graph_capturable = True`: `build_decode_metadata` returns
views of the persistent `DecodeGraphBuffers` (block table, seq_lens, slots), the decode kernel
reads each row's seq_len on the device, and its split-K choice depends on shapes only, so one
metadata per batch size serves every refill, and the decode forward neither synchronises with the
host nor allocates anything sized by the buffers' values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from servelm.attention.backend import AttentionMetadata, CommonAttentionInputs, DecodeGraphBuffers
from servelm.attention.kv_storage import LayerKVCache, QuantizedKV
from servelm.kernels.triton.decode_attention import choose_num_splits, paged_decode_attention
from servelm.kernels.triton.kv_write import write_kv
from servelm.kernels.triton.pool import CODE_DTYPES, FULL_DTYPES, KVPool
from servelm.kernels.triton.prefill_attention import fresh_kv, paged_prefill_attention, plan_tiles


@dataclass(frozen=True)
class DecodeRows:
    """The step's decode requests (one new token each), rows of the paged decode kernel."""

    block_table: torch.Tensor  # [R, max_blocks] int32, on device: every request's row
    seq_lens: torch.Tensor  # [R] int32, on device
    # [rows] int32, on device: each decode row's request and token row; None: row i is request i
    # and token i (every request of the step is a decode, and every captured decode step)
    requests: torch.Tensor | None
    token_rows: torch.Tensor | None
    num_rows: int
    max_context: int  # the longest seq_len a row may have (host): sizes the split-K choice


@dataclass(frozen=True)
class PrefillTiles:
    """Every other request, cut into tiles of queries for the prefill kernel."""

    block_table: torch.Tensor | None  # [R, max_blocks] int32, on device; None: no pool, fresh K/V
    query_start_loc: torch.Tensor  # [R + 1] int32, on device
    seq_lens: torch.Tensor  # [R] int32, on device
    tile_requests: torch.Tensor  # [tiles] int32, on device
    tile_starts: torch.Tensor  # [tiles] int32, on device


@dataclass(frozen=True)
class TritonAttentionMetadata(AttentionMetadata):
    """The Triton backend's plan for one step, built once, read by every layer."""

    slot_mapping: torch.Tensor | None  # [T] long, on device: where new K/V are written; None without a pool
    block_size: int  # of the pool the plan addresses (0 without one)
    decodes: DecodeRows | None
    prefills: PrefillTiles | None

    @property
    def reads_kv_pool(self) -> bool:
        return self.decodes is not None or (self.prefills is not None and self.prefills.block_table is not None)


def check_kv_dtype(kv_dtype: torch.dtype, device: torch.device) -> None:
    """ValueError unless the kernels read and write a pool of `kv_dtype` on `device`."""
    if kv_dtype not in FULL_DTYPES + CODE_DTYPES:
        raise ValueError(
            f"the triton attention backend does not support a KV pool of {kv_dtype}; "
            f"valid: {[str(d) for d in FULL_DTYPES + CODE_DTYPES]} (use --attention-backend torch)"
        )
    if kv_dtype == torch.float8_e4m3fn and device.type == "cuda" and _capability(device) < (8, 9):
        raise ValueError(
            f"the triton attention backend's fp8 KV needs compute capability 8.9+ (Triton has no e4m3 before it); "
            f"{device} is {_capability(device)}: use --kv-cache-dtype int8, or --attention-backend torch"
        )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def kv_pool_of(kv_cache: LayerKVCache) -> KVPool:
    """One layer's pool ([2, num_blocks, block_size, KVH, D], or a QuantizedKV) as the kernels take it."""
    if isinstance(kv_cache, QuantizedKV):
        return KVPool(kv_cache.data[0], kv_cache.data[1], kv_cache.scales[0], kv_cache.scales[1])
    return KVPool(kv_cache[0], kv_cache[1])


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (what split-K fills); 1 elsewhere (the interpreter
    runs one program at a time: splitting gains nothing there)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _to_device(common: CommonAttentionInputs, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`parts` (int32, CPU) on common.device after one copy: views of one packed tensor."""
    packed = torch.cat([part.reshape(-1).to(torch.int32) for part in parts])
    on_device = packed.to(common.device, non_blocking=True)
    return list(on_device.split([part.numel() for part in parts]))


class TritonAttentionBackend:
    name = "triton"
    graph_capturable = True

    def __init__(self, multiprocessors: int | None = None) -> None:
        # None: the device's own count; tests give one to exercise split-K where it would not split.
        self.multiprocessors = multiprocessors

    def build_metadata(self, common: CommonAttentionInputs) -> TritonAttentionMetadata:
        """See `AttentionBackend.build_metadata`: once per step, pure. Raises ValueError for a pool
        dtype the kernels do not support, and for cached context without a pool."""
        check_kv_dtype(common.kv_dtype, common.device)
        is_decode = common.query_lens == 1 if common.has_kv_pool else torch.zeros(common.num_requests, dtype=torch.bool)
        decode_requests = torch.nonzero(is_decode).flatten()  # [Rd] ascending: batch order
        prefill_requests = torch.nonzero(~is_decode).flatten()
        if not common.has_kv_pool and bool((common.seq_lens > common.query_lens).any()):
            raise ValueError("a chunk after cached context needs a KV pool (block_table and slot_mapping)")
        tile_requests, tile_starts = plan_tiles(common.query_lens, prefill_requests)
        indexed = 0 < decode_requests.numel() < common.num_requests
        parts = [common.seq_lens, common.query_start_loc, tile_requests, tile_starts]
        if common.block_table is not None:
            parts.append(common.block_table.contiguous())
        if indexed:
            parts += [decode_requests, common.query_start_loc[decode_requests]]
        seq_lens, query_start_loc, tiles, starts, *rest = _to_device(common, parts)
        block_table = rest[0].view(common.block_table.shape) if common.block_table is not None else None
        decodes = prefills = None
        if decode_requests.numel():
            assert block_table is not None  # decodes exist only with a pool
            requests, token_rows = (rest[1], rest[2]) if indexed else (None, None)
            decodes = DecodeRows(
                block_table, seq_lens, requests, token_rows, decode_requests.numel(), common.max_seq_len
            )
        if prefill_requests.numel():
            prefills = PrefillTiles(block_table, query_start_loc, seq_lens, tiles, starts)
        return TritonAttentionMetadata(common.slot_mapping, common.block_size, decodes, prefills)

    def build_decode_metadata(
        self, buffers: DecodeGraphBuffers, batch: int, *, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> TritonAttentionMetadata:
        """See `DecodeGraphBackend`: views of rows [0, batch) of the buffers, valid for every refill."""
        check_kv_dtype(kv_dtype, buffers.block_table.device)
        if not 1 <= batch <= buffers.max_batch:
            raise ValueError(f"batch must be in 1..{buffers.max_batch} (the buffers' rows), got {batch}")
        if buffers.seq_lens.dtype != torch.int32 or buffers.block_table.dtype != torch.int32:
            raise ValueError("DecodeGraphBuffers' seq_lens and block_table must be int32")
        max_context = buffers.block_table.shape[1] * buffers.block_size  # no host read of seq_lens
        decodes = DecodeRows(buffers.block_table[:batch], buffers.seq_lens[:batch], None, None, batch, max_context)
        return TritonAttentionMetadata(buffers.slot_mapping[:batch], buffers.block_size, decodes, None)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: LayerKVCache | None,  # [2, num_blocks, block_size, KVH, D] (kv_storage.py)
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        if not isinstance(metadata, TritonAttentionMetadata):
            raise TypeError(f"the triton backend needs TritonAttentionMetadata, got {type(metadata).__name__}")
        query = query if query.stride(-1) == 1 else query.contiguous()
        output = query.new_empty(query.shape)
        pool = None
        if kv_cache is not None:
            if metadata.slot_mapping is None:
                raise ValueError("a KV pool was given but the metadata was built without one (no slot_mapping)")
            pool = kv_pool_of(kv_cache)
            if pool.block_size != metadata.block_size:
                raise ValueError(f"the pool's block_size {pool.block_size} is not the metadata's {metadata.block_size}")
            write_kv(key, value, pool, metadata.slot_mapping)
        elif metadata.reads_kv_pool:
            raise ValueError("the metadata reads K/V from the pool but no kv_cache was given")
        decodes = metadata.decodes
        if decodes is not None:
            assert pool is not None  # reads_kv_pool, checked above
            multiprocessors = self.multiprocessors or _multiprocessors(query.device)
            splits = choose_num_splits(decodes.num_rows, pool.num_kv_heads, decodes.max_context, multiprocessors)
            paged_decode_attention(output, query, pool, decodes.block_table, decodes.seq_lens, scale,
                                   requests=decodes.requests, token_rows=decodes.token_rows, num_splits=splits)  # fmt: skip
        prefills = metadata.prefills
        if prefills is not None:
            kv = pool if pool is not None else fresh_kv(key, value)
            paged_prefill_attention(output, query, kv, prefills.block_table, prefills.query_start_loc,
                                    prefills.seq_lens, prefills.tile_requests, prefills.tile_starts, scale)  # fmt: skip
        return output
