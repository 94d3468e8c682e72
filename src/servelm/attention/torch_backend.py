"""The reference attention backend: plain PyTorch (SDPA), runs on CPU, CUDA, anywhere.

`build_metadata` plans the step once; the layers only read the plan:

- Decodes (one new token per request) are attended together in one call, in place
  (requests are never reordered: the runner's sample rows follow scheduler order).
  On CPU in float32 the paged kernel of `servelm.kernels.cpu` reads K/V (float32, or int8
  codes and scales) straight from the blocks (`KernelDecodes`); elsewhere (an fp8 pool too),
  or without a compiler, they are gathered and dequantized into one padded batch for SDPA
  (`GatherDecodes`). A lone decode with no kernel goes with the chunks (one SDPA call either way).
- Short queries after cached context (speculative verification: 1 + k tokens, up to 12;
  a prompt's short last chunk after a prefix hit) join the decodes, one decode row per
  token: token j of a request with query_len q and seq_len S is a decode at seq_len
  S - q + j + 1 over the request's own block table. `forward` writes every new token's
  K/V before attending, so that row sees exactly the keys causality allows. A request's
  rows stay adjacent (its K/V are read q times in a row, from cache after the first).
- Prefill chunks are attended one request at a time (their shapes differ): a chunk
  with nothing cached before it (a whole new prompt) attends to its own fresh K/V with
  SDPA's causal flag, skipping the pool and the mask; a chunk after cached context
  reads its context from the pool by precomputed slots and masks causally (a long chunk on
  CPU: the context and its own keys in two flash calls, merged, `_context_then_causal`; a shorter
  one on CPU in float32: the compiled chunk kernel, straight from the blocks, no gather, no mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from servelm.attention.backend import (
    AttentionMetadata,
    CommonAttentionInputs,
    DecodeGraphBuffers,
    register_backend,
    slots_of,
)
from servelm.attention.kv_storage import LayerKVCache, QuantizedKV, gather_kv, gather_kv_blocks, write_kv
from servelm.kernels import cpu as cpu_kernels


def _causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor | None:
    """Query i (at position num_keys - num_queries + i) sees keys 0..that position."""
    if num_queries == 1:
        return None
    offset = num_keys - num_queries
    rows = torch.arange(num_queries, device=device).unsqueeze(1) + offset
    cols = torch.arange(num_keys, device=device).unsqueeze(0)
    return cols <= rows  # [num_queries, num_keys] bool, True = attend


# A chunk after cached context is attended in two flash calls merged by their log-sum-exps
# (the context without a mask, the chunk's own keys with the causal flag, whose kernel skips the
# masked half) from this many queries on: one masked call computes the whole [queries, keys]
# rectangle, and converts the mask for every layer. Measured on the default model's layer shape
# (9 query heads over 3 KV heads, d 64; 2 AVX-512 cores, float32): 1,973 queries after 2,048
# cached 84 -> 58 ms, 657 after 2,528 23 -> 20 ms, 512 after 3,072 20 -> 18 ms, and 128 after
# 3,500 5.7 -> 6.1 ms (the second call and the merge outweigh the triangle saved).
SPLIT_ATTENTION_MIN_QUERIES = 256
# The CPU flash kernel that also returns each row's log-sum-exp (SDPA itself drops it); private
# to PyTorch, so its absence (another version) means one masked call as before.
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _splits_at_context(num_queries: int, device: torch.device) -> bool:
    return device.type == "cpu" and _CPU_FLASH_WITH_LSE is not None and num_queries >= SPLIT_ATTENTION_MIN_QUERIES


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
            mask: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """query: [q, H, D]; key/value: [k, KVH, D] → [q, H, D] in query's dtype, causal with the query
    block at the end. `mask`: _causal_mask(q, k) when the caller has it (it is the same for every
    layer of a step). `compute_dtype`: what SDPA computes in (None: query's dtype)."""
    num_queries, num_keys = query.shape[0], key.shape[0]
    dtype = compute_dtype or query.dtype
    q, k, v = (t.transpose(0, 1).unsqueeze(0).to(dtype) for t in (query, key, value))  # [1, heads, len, D]
    if num_queries < num_keys and _splits_at_context(num_queries, query.device):
        out = _context_then_causal(q, k, v, num_keys - num_queries, scale)
    else:
        square = num_queries == num_keys  # no context before the queries: SDPA's own causal mask fits
        if mask is None and not square:
            mask = _causal_mask(num_queries, num_keys, query.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=square and num_queries > 1,
                                             scale=scale, enable_gqa=True)  # fmt: skip
    return out.squeeze(0).transpose(0, 1).to(query.dtype)


def _context_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                         scale: float) -> torch.Tensor:  # fmt: skip
    """Softmax attention of q ([1, H, q, D]) over k, v ([1, KVH, context_len + q, D]), causal within
    the last q keys, as two flash calls: every query sees the whole context, and its own block
    causally. Each call's output is normalised over its own keys; weighting them by
    exp(lse_i) / (exp(lse_1) + exp(lse_2)) = sigmoid(lse_1 - lse_2) gives the softmax over all."""
    assert _CPU_FLASH_WITH_LSE is not None  # _splits_at_context checked
    over_context, lse_context = _CPU_FLASH_WITH_LSE(q, k[:, :, :context_len], v[:, :, :context_len], scale=scale)
    over_chunk, lse_chunk = _CPU_FLASH_WITH_LSE(q, k[:, :, context_len:], v[:, :, context_len:], is_causal=True,
                                                scale=scale)  # fmt: skip
    context_weight = torch.sigmoid(lse_context.float() - lse_chunk.float()).unsqueeze(-1)  # [1, H, q, 1]
    return torch.lerp(over_chunk.float(), over_context.float(), context_weight).to(q.dtype)


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
        k_pool: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 (or int8 codes) contiguous
        v_pool: torch.Tensor,
        batch: Any,
        scale: float,
        pool_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 codes' K and V scales
    ) -> torch.Tensor: ...  # [B, H, D]


def _paged_kernel(device: torch.device, dtype: torch.dtype) -> PagedDecodeKernel | None:
    """The CPU decode kernel when it applies (float32 on CPU, and it could be built), else None."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return cpu_kernels.load()


# What the kernel reads from the pool: float32 values, or int8 codes with their scales.
_KERNEL_KV_DTYPES = (torch.float32, torch.int8)


# -- decode path ---------------------------------------------------------------------------

# The longest query after cached context that is attended as decode rows (one per token); longer
# chunks go to the prefill path, where one SDPA call over the gathered context amortizes better.
# The kernel's cost grows by one decode per row; measured (135M default model's geometry, context
# 1500, 30 layers, 1 thread) it beats the chunk path up to ~10 rows and loses 1.25x at 16.
SHORT_QUERY_MAX = 12


@dataclass(frozen=True)
class KernelDecodes:
    """The step's decode rows, attended by the CPU paged kernel straight from the blocks.

    B decode rows: one per decode request, one per token of each short query (see the module)."""

    kernel: PagedDecodeKernel
    rows: torch.Tensor  # [B] long, ascending: each decode row's token row in the flattened batch
    covers_batch: bool  # every token of the step is a decode row (rows == 0..B-1)
    # The kernel's checked batch: block tables [B, ceil(max_seq_len / block_size)] int32 (a request's
    # row repeated for each of its decode rows) and seq lens [B] int32 on CPU, prepared once here
    # for every layer's call.
    batch: Any

    def attend(self, query: torch.Tensor, kv_cache: LayerKVCache, scale: float) -> torch.Tensor:  # [B, H, D]
        q = query.contiguous() if self.covers_batch else query.index_select(0, self.rows)
        if isinstance(kv_cache, QuantizedKV):
            codes, scales = kv_cache.data, kv_cache.scales
            # [-1]: V, or the one latent plane that is both (kv_storage.py).
            return self.kernel.decode_prepared(q, codes[0], codes[-1], self.batch, scale, (scales[0], scales[-1]))
        if not kv_cache.is_contiguous():
            raise ValueError("the CPU paged decode kernel needs a contiguous KV pool tensor")
        return self.kernel.decode_prepared(q, kv_cache[0], kv_cache[-1], self.batch, scale)


@dataclass(frozen=True)
class GatherDecodes:
    """The step's decode rows (as in KernelDecodes) for SDPA: each planned request's K/V gathered from
    the pool once into a padded batch, its queries side by side (padded to the longest), masked per row.

    R' planned requests, Q = their longest query (1 when all are decodes), B decode rows."""

    rows: torch.Tensor  # [B] long, on device, ascending: each decode row's token row in the flattened batch
    covers_batch: bool  # every token of the step is a decode row
    # [R', Q] long, on device: token row of request r's query j (its last query again past its query_len)
    query_rows: torch.Tensor
    outputs: torch.Tensor  # [B] long, on device: decode row b's place in the [R' * Q] flattened output
    slots: torch.Tensor  # [R', max_seq_len] long, on device: pool slot per position, 0 past a request's length
    valid: torch.Tensor  # [R', 1, Q, max_seq_len] bool, on device: key mask per query row, True = attend

    def attend(self, query: torch.Tensor, kv_cache: LayerKVCache, scale: float) -> torch.Tensor:  # [B, H, D]
        k = gather_kv(kv_cache, 0, self.slots, query.dtype).transpose(1, 2)  # [R', KVH, max_len, D]
        v = gather_kv(kv_cache, 1, self.slots, query.dtype).transpose(1, 2)
        q = query[self.query_rows].transpose(1, 2)  # [R', H, Q, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.valid, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).flatten(0, 1)[self.outputs]  # [R' * Q, H, D] -> [B, H, D]


@dataclass(frozen=True)
class DecodeGrid:
    """Requests planned as decodes, one grid entry per (request, query position j < Q), on the CPU.

    Entries past a request's query_len repeat its last real one (padding the gather path computes
    and drops); `real` marks the others, the decode rows, in batch order when read row-major."""

    requests: torch.Tensor  # [R'] long, ascending: the planned requests' batch indices
    token_rows: torch.Tensor  # [R', Q] long: token row of query j of request r in the flattened batch
    seq_lens: torch.Tensor  # [R', Q] int32: keys query j attends to (its own position + 1)
    real: torch.Tensor  # [R', Q] bool: j < the request's query_len


def _decode_grid(common: CommonAttentionInputs, indices: torch.Tensor) -> DecodeGrid:
    """The grid of requests `indices` ([R'] long, ascending): query j of request i (of q_i new tokens)
    is token row query_start_loc[i] + j, a decode at seq_len seq_lens[i] - q_i + j + 1."""
    query_lens = common.query_lens[indices].unsqueeze(1)  # [R', 1] int32
    j = torch.arange(int(query_lens.max())).unsqueeze(0)  # [1, Q]
    real = j < query_lens
    j = torch.minimum(j, query_lens - 1)  # [R', Q]: padding repeats the last real query
    token_rows = common.query_start_loc[indices].unsqueeze(1).long() + j
    seq_lens = (common.seq_lens[indices].unsqueeze(1) - query_lens + 1 + j).to(torch.int32)
    return DecodeGrid(indices, token_rows, seq_lens, real)


def _build_decodes(common: CommonAttentionInputs, indices: torch.Tensor) -> KernelDecodes | GatherDecodes | None:
    """The decode plan for requests `indices` ([R'] long, ascending), or None when they go with the chunks."""
    assert common.block_table is not None and indices.numel() > 0
    kernel = _paged_kernel(common.device, common.dtype) if common.kv_dtype in _KERNEL_KV_DTYPES else None
    if kernel is None and indices.numel() == 1:
        return None  # a lone request without the kernel: the chunk path is one SDPA call too
    grid = _decode_grid(common, indices)
    rows = grid.token_rows[grid.real]  # [B] ascending
    max_seq_len = int(grid.seq_lens.max())
    covers_batch = rows.numel() == common.num_tokens
    bs = common.block_size
    if kernel is not None:
        # One kernel row per decode row, a request's table repeated for each. Only the blocks a
        # row's seq_len reaches are read; the columns past them never are.
        width = (max_seq_len + bs - 1) // bs
        row_requests = grid.requests.unsqueeze(1).expand_as(grid.real)[grid.real]  # [B]
        tables = common.block_table[row_requests, :width].contiguous()  # [B, width]
        batch = kernel.prepare_decode(tables, grid.seq_lens[grid.real].contiguous(), max_seq_len)
        return KernelDecodes(kernel, rows, covers_batch, batch)
    positions = torch.arange(max_seq_len)  # [max_len]
    valid = positions < grid.seq_lens.unsqueeze(2)  # [R', Q, max_len]
    width = common.block_table.shape[1]
    clamped = positions.clamp(max=width * bs - 1)  # positions past every length index inside the table
    slots = slots_of(common.block_table, indices.unsqueeze(1), clamped.unsqueeze(0), bs)  # [R', max_len]
    device = common.device
    return GatherDecodes(
        rows=rows.to(device, non_blocking=True),
        covers_batch=covers_batch,
        query_rows=grid.token_rows.to(device, non_blocking=True),
        outputs=torch.nonzero(grid.real.flatten()).flatten().to(device, non_blocking=True),
        slots=slots.masked_fill(~valid[:, -1], 0).to(device, non_blocking=True),  # the last query sees the most
        valid=valid.unsqueeze(1).to(device, non_blocking=True),
    )


# -- prefill path --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillChunk:
    """One request's chunk of new tokens, attended on its own."""

    start: int  # first token row of the chunk in the flattened batch
    end: int  # one past its last row
    # [ceil(seq_len / block_size)] long, on device: the request's blocks, in order, holding positions
    # 0..seq_len-1 (context, then the chunk); None when nothing is cached before the chunk and it
    # attends to its own fresh K/V.
    context_blocks: torch.Tensor | None
    seq_len: int = 0  # keys the chunk attends to (with context_blocks)
    # With context: which keys each query sees ([end - start, seq_len] bool), made once for every layer
    # (made per layer it was ~2% of a long prompt's prefill).
    context_mask: torch.Tensor | None = None
    compute_dtype: torch.dtype | None = None  # TorchAttentionBackend.prefill_compute_dtype
    # With context on CPU in float32: the compiled kernel that attends straight from the blocks, and
    # the blocks as it reads them (int32); None: gather the context and run SDPA.
    kernel: PagedChunkKernel | None = None
    kernel_blocks: torch.Tensor | None = None

    def attend(self, query, key, value, kv_cache: LayerKVCache | None, scale: float) -> torch.Tensor:
        s, e = self.start, self.end
        if self.context_blocks is None:
            return _attend(query[s:e], key[s:e], value[s:e], scale, compute_dtype=self.compute_dtype)
        assert kv_cache is not None  # TorchAttentionBackend.forward checked
        if self.kernel is not None and self.kernel_blocks is not None and _kernel_reads(kv_cache, query):
            assert isinstance(kv_cache, torch.Tensor)  # _kernel_reads checked
            context = self.seq_len - (e - s)
            return self.kernel.chunk_attention(query[s:e].contiguous(), kv_cache[0], kv_cache[1], self.kernel_blocks,
                                               context, scale)  # fmt: skip
        k = gather_kv_blocks(kv_cache, 0, self.context_blocks, self.seq_len, query.dtype)  # [seq_len, KVH, D]
        v = gather_kv_blocks(kv_cache, 1, self.context_blocks, self.seq_len, query.dtype)
        return _attend(query[s:e], k, v, scale, self.context_mask, self.compute_dtype)


class PagedChunkKernel(Protocol):
    """The compiled CPU chunk-after-context kernel (`cpu_kernels.load()`), see CpuKernels.chunk_attention."""

    def chunk_attention(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                        context: int, scale: float) -> torch.Tensor: ...  # fmt: skip


# The kernel's limits (csrc/chunk_attention.c): head_dim a multiple of 8 up to this, and at most
# CHUNK_KERNEL_MAX_GROUP query heads per KV head.
CHUNK_KERNEL_MAX_HEAD_DIM = 256
CHUNK_KERNEL_MAX_GROUP = 48


def _chunk_kernel(common: CommonAttentionInputs, compute_dtype: torch.dtype | None) -> PagedChunkKernel | None:
    """The chunk kernel when a step's chunks after context may take it: CPU, a float32 model and pool,
    attention computed in float32, and a build that has it."""
    if common.device.type != "cpu" or common.dtype != torch.float32 or common.kv_dtype != torch.float32:
        return None
    if compute_dtype not in (None, torch.float32):
        return None
    kernels = cpu_kernels.load()
    return kernels if kernels is not None and kernels.has_chunk_attention else None


def _kernel_reads(kv_cache: LayerKVCache, query: torch.Tensor) -> bool:
    """Whether this layer's pool and queries fit the chunk kernel (a latent pool or another head
    geometry takes the SDPA path)."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous():
        return False
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        return False
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = kv_cache.shape[3]
    return (kv_cache.shape[4] == head_dim and head_dim % 8 == 0 and head_dim <= CHUNK_KERNEL_MAX_HEAD_DIM
            and heads % kv_heads == 0 and heads // kv_heads <= CHUNK_KERNEL_MAX_GROUP)  # fmt: skip


def _build_chunks(common: CommonAttentionInputs, indices: list[int],
                  compute_dtype: torch.dtype | None = None) -> tuple[PrefillChunk, ...]:  # fmt: skip
    """Chunks of requests `indices`; the context blocks of all of them reach the device in one copy."""
    starts = common.query_start_loc.tolist()
    seq_lens = common.seq_lens.tolist()
    with_context = [i for i in indices if seq_lens[i] > starts[i + 1] - starts[i]]
    if with_context and common.block_table is None:
        raise ValueError("a chunk after cached context needs a KV pool (block_table and slot_mapping)")
    context: dict[int, torch.Tensor] = {}
    if with_context:
        assert common.block_table is not None
        num_blocks = [-(-seq_lens[i] // common.block_size) for i in with_context]
        per_request = [common.block_table[i, :n].long() for i, n in zip(with_context, num_blocks)]
        on_device = torch.cat(per_request).to(common.device, non_blocking=True)
        context = dict(zip(with_context, on_device.split(num_blocks)))
    # Chunks SDPA would attend in one masked call go to the kernel where it applies; those it
    # splits in two flash calls stay there (as fast as the kernel, or faster, from 256 queries).
    masked = [i for i in context if not _splits_at_context(starts[i + 1] - starts[i], common.device)]
    kernel = _chunk_kernel(common, compute_dtype) if masked else None
    kernel_blocks = {i: context[i].to(torch.int32) for i in masked} if kernel is not None else {}
    # (A kernel chunk on a layer the kernel cannot read, a latent pool, makes its mask in _attend.)
    masks = {i: _causal_mask(starts[i + 1] - starts[i], seq_lens[i], common.device) for i in masked
             if i not in kernel_blocks}  # fmt: skip
    return tuple(PrefillChunk(starts[i], starts[i + 1], context.get(i), seq_lens[i], masks.get(i), compute_dtype,
                              kernel if i in kernel_blocks else None, kernel_blocks.get(i))
                 for i in indices)  # fmt: skip


# -- the backend ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The torch backend's plan for one step, built once by `build_metadata`, read by every layer."""

    slot_mapping: torch.Tensor | None  # [T] long, on device: where new K/V are written; None without a pool
    decodes: KernelDecodes | GatherDecodes | None  # the step's decode rows together, or None
    chunks: tuple[PrefillChunk, ...]  # every other request, in batch order

    @property
    def reads_kv_pool(self) -> bool:
        return self.decodes is not None or any(c.context_blocks is not None for c in self.chunks)


class TorchAttentionBackend:
    name = "torch"
    # Its decode metadata holds host copies of the buffers' lengths and tables (the CPU kernel's
    # prepared batch, SDPA's gather slots): built again after every refill, never captured.
    graph_capturable = False
    prefill_compute_dtype: torch.dtype | None = None  # (a subclass that skips __init__ keeps the model's dtype)

    def __init__(self, prefill_compute_dtype: torch.dtype | None = None) -> None:
        # What prefill chunks' SDPA computes in; None: the model's dtype. bfloat16 for a CPU float32
        # model under `--gemm-precision bfloat16` (models/gemm_precision.py): SDPA's two GEMMs on AMX,
        # the output float32 again. Decode rows stay in the model's dtype.
        self.prefill_compute_dtype = prefill_compute_dtype

    def build_metadata(self, common: CommonAttentionInputs) -> TorchAttentionMetadata:
        """See `AttentionBackend.build_metadata`: once per step, pure."""
        decodes = None
        # Decodes, and short queries after cached context; whole new prompts stay chunks.
        short_after_context = (common.query_lens <= SHORT_QUERY_MAX) & (common.seq_lens > common.query_lens)
        decode_indices = torch.nonzero((common.query_lens == 1) | short_after_context).flatten()  # [R'] ascending
        if common.has_kv_pool and decode_indices.numel():
            decodes = _build_decodes(common, decode_indices)
        in_decodes = set(decode_indices.tolist()) if decodes is not None else set()
        chunk_indices = [i for i in range(common.num_requests) if i not in in_decodes]
        chunks = _build_chunks(common, chunk_indices, self.prefill_compute_dtype)
        return TorchAttentionMetadata(common.slot_mapping, decodes, chunks)

    def build_decode_metadata(
        self, buffers: DecodeGraphBuffers, batch: int, *, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> TorchAttentionMetadata:
        """See `DecodeGraphBackend`: the decode plan of rows [0, batch) as the buffers hold them now
        (read to the host), through `build_metadata`; valid until the next refill."""
        seq_lens = buffers.seq_lens[:batch].cpu()  # [batch] int32
        width = (int(seq_lens.max()) + buffers.block_size - 1) // buffers.block_size  # the columns any row reaches
        common = CommonAttentionInputs.from_lens(
            torch.ones(batch, dtype=torch.int32),
            seq_lens,
            slot_mapping=buffers.slot_mapping[:batch],
            block_table=buffers.block_table[:batch, :width].cpu(),
            block_size=buffers.block_size,
            device=buffers.input_ids.device,
            dtype=dtype,
            kv_dtype=kv_dtype,
        )
        return self.build_metadata(common)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: LayerKVCache | None,  # [2, num_blocks, block_size, KVH, D] (kv_storage.py)
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        if not isinstance(metadata, TorchAttentionMetadata):
            raise TypeError(f"the torch backend needs TorchAttentionMetadata, got {type(metadata).__name__}")
        if kv_cache is not None:
            if metadata.slot_mapping is None:
                raise ValueError("a KV pool was given but the metadata was built without one (no slot_mapping)")
            # Fresh chunks attend to their K/V as stored: with a quantized pool, dequantized codes.
            key, value = write_kv(kv_cache, key, value, metadata.slot_mapping)
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
