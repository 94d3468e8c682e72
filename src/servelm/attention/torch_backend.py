"""The reference attention backend: plain PyTorch (SDPA), runs on CPU, CUDA, anywhere.

Prefill chunks are attended one request at a time (their shapes differ); a chunk with
nothing cached before it (a whole new prompt) attends to its own fresh K/V with SDPA's
causal flag, skipping the pool and the mask. Decodes (one new token per request) are
attended together in one call: on CPU in float32 by the paged kernel of
`servelm.kernels.cpu`, which reads K/V straight from the blocks; elsewhere
(or without a compiler) gathered into one padded batch for SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.attention.backend import AttentionMetadata, register_backend
from servelm.kernels import cpu as cpu_kernels


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V at their pool slots. kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def context_slots(block_table: list[int], seq_len: int, block_size: int) -> list[int]:
    """Pool slots of positions [0, seq_len) of one request, in position order."""
    slots: list[int] = []
    for block_id in block_table[: (seq_len + block_size - 1) // block_size]:
        base = block_id * block_size
        slots.extend(range(base, base + block_size))
    return slots[:seq_len]


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


def _paged_kernel(query: torch.Tensor, kv_cache: torch.Tensor):
    """The CPU decode kernel when it applies here (float32 on CPU, and it could be built), else None."""
    if query.device.type != "cpu" or query.dtype != torch.float32 or kv_cache.dtype != torch.float32:
        return None
    if not kv_cache.is_contiguous():
        return None
    return cpu_kernels.load()


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if kv_cache is None:
            return self._forward_without_cache(query, key, value, metadata, scale)
        assert metadata.slot_mapping is not None and metadata.block_tables is not None
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        decode_indices = self._decode_indices(metadata)
        kernel = _paged_kernel(query, kv_cache)
        if kernel is not None and len(decode_indices) == metadata.num_requests:
            return self._kernel_decodes(kernel, query, kv_cache, metadata, decode_indices, scale)  # all decodes
        output = query.new_empty(query.shape)  # contiguous even when query is a strided view
        done: set[int] = set()
        if decode_indices and (kernel is not None or len(decode_indices) > 1):
            if kernel is not None:
                rows = self._decode_rows(metadata, decode_indices, query.device)
                output[rows] = self._kernel_decodes(kernel, query, kv_cache, metadata, decode_indices, scale)
            else:
                self._forward_decodes(query, kv_cache, metadata, decode_indices, scale, output)
            done = set(decode_indices)
        starts = metadata.query_start_loc
        for i in range(metadata.num_requests):
            if i in done:
                continue
            s, e = starts[i], starts[i + 1]
            if metadata.seq_lens[i] == e - s:  # nothing cached before this chunk: its own K/V are all it sees
                output[s:e] = _attend(query[s:e], key[s:e], value[s:e], scale)
                continue
            slots = self._slots_tensor(metadata, i, query.device)
            k = kv_cache[0].view(-1, *kv_cache.shape[3:])[slots]  # [seq_len, KVH, D]
            v = kv_cache[1].view(-1, *kv_cache.shape[3:])[slots]
            output[s:e] = _attend(query[s:e], k, v, scale)
        return output

    @staticmethod
    def _decode_indices(metadata: AttentionMetadata) -> list[int]:
        """Requests with exactly one new token this step (computed once per step)."""
        if "decode_indices" not in metadata.derived:
            metadata.derived["decode_indices"] = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        return metadata.derived["decode_indices"]

    @staticmethod
    def _decode_rows(metadata: AttentionMetadata, indices: list[int], device: torch.device) -> torch.Tensor:
        """Flattened token row of each decode, [B] long."""
        if "decode_rows" not in metadata.derived:
            rows = [metadata.query_start_loc[i] for i in indices]
            metadata.derived["decode_rows"] = torch.tensor(rows, dtype=torch.long, device=device)
        return metadata.derived["decode_rows"]

    def _kernel_decodes(self, kernel, query, kv_cache, metadata, indices: list[int], scale: float) -> torch.Tensor:
        """Paged attention of the decodes, [B, H, D], in `indices` order."""
        if "kernel_tables" not in metadata.derived:
            lens = [metadata.seq_lens[i] for i in indices]
            bs = metadata.block_size
            width = (max(lens) + bs - 1) // bs
            # Only the blocks a request's seq_len reaches are read; the padding is never touched.
            tables = [metadata.block_tables[i][:width] for i in indices]
            tables = [t + [0] * (width - len(t)) for t in tables]
            metadata.derived["kernel_tables"] = (
                torch.tensor(tables, dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32),
                max(lens),
            )
        tables, lens, max_len = metadata.derived["kernel_tables"]
        if len(indices) == query.shape[0]:
            q = query.contiguous()
        else:
            q = query.index_select(0, self._decode_rows(metadata, indices, query.device))
        return kernel.decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, max_len, scale)

    @staticmethod
    def _forward_without_cache(query, key, value, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        output = query.new_empty(query.shape)  # contiguous even when query is a strided view
        starts = metadata.query_start_loc
        for i in range(metadata.num_requests):
            s, e = starts[i], starts[i + 1]
            output[s:e] = _attend(query[s:e], key[s:e], value[s:e], scale)
        return output

    @staticmethod
    def _slots_tensor(metadata: AttentionMetadata, i: int, device: torch.device) -> torch.Tensor:
        # Derived once per step and reused by every layer.
        key = ("slots", i)
        if key not in metadata.derived:
            slots = context_slots(metadata.block_tables[i], metadata.seq_lens[i], metadata.block_size)
            metadata.derived[key] = torch.tensor(slots, dtype=torch.long, device=device)
        return metadata.derived[key]

    @staticmethod
    def _decode_gather(metadata: AttentionMetadata, indices: list[int], device: torch.device):
        """Padded slot matrix [B, max_len] and key mask [B, 1, 1, max_len] for the decodes."""
        key = ("decode", tuple(indices))
        if key not in metadata.derived:
            lens = [metadata.seq_lens[i] for i in indices]
            max_len = max(lens)
            padded = [
                context_slots(metadata.block_tables[i], n, metadata.block_size) + [0] * (max_len - n)
                for i, n in zip(indices, lens)
            ]
            slots = torch.tensor(padded, dtype=torch.long, device=device)
            valid = torch.arange(max_len, device=device).unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
            metadata.derived[key] = (slots, valid[:, None, None, :])
        return metadata.derived[key]

    def _forward_decodes(self, query, kv_cache, metadata, indices: list[int], scale: float, output) -> None:
        slots, valid = self._decode_gather(metadata, indices, query.device)
        token_index = torch.tensor([metadata.query_start_loc[i] for i in indices], device=query.device)
        pool_k = kv_cache[0].view(-1, *kv_cache.shape[3:])
        pool_v = kv_cache[1].view(-1, *kv_cache.shape[3:])
        k = pool_k[slots].transpose(1, 2).to(query.dtype)  # [B, KVH, max_len, D]
        v = pool_v[slots].transpose(1, 2).to(query.dtype)
        q = query[token_index].unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid, scale=scale, enable_gqa=True)
        output[token_index] = out.squeeze(2)


register_backend("torch", TorchAttentionBackend)
