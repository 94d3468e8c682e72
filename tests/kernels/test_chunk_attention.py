"""The CPU chunk-after-context attention kernel (csrc/chunk_attention.c) against SDPA over the same
K/V gathered by hand: chunk sizes across its query tiles (one row, a partial tile, several tiles,
one and two row groups),
context before the chunk from none to several key tiles, GQA groupings up to its 48-row limit, head
sizes, block sizes that do and do not divide its 32-key tile, blocks scattered through the pool; and
in the attention backend, a step whose chunk after context takes the kernel against the same step
without it. Bad arguments are named, never read through."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from servelm.attention import torch_backend
from servelm.attention.backend import CommonAttentionInputs
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.kernels import cpu
from servelm.kernels.arguments import KernelArgumentError


def _scattered_chunk(num_queries: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(query [Q, H, D], pool [2, num_blocks, bs, KVH, D], the request's blocks [n] int32), its
    blocks in a shuffled order with unused ones between them."""
    rng = random.Random(seed)
    needed = -(-(context + num_queries) // block_size)
    ids = list(range(needed + 5))
    rng.shuffle(ids)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, needed + 5, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(num_queries, heads, head_dim, generator=gen)
    return query, pool, torch.tensor(ids[:needed], dtype=torch.int32)


def _reference(query: torch.Tensor, pool: torch.Tensor, blocks: torch.Tensor, context: int, scale: float) -> torch.Tensor:
    """SDPA over the request's keys in position order, query i seeing keys 0..context + i."""
    num_queries = query.shape[0]
    bs = pool.shape[2]
    slots = torch.tensor([int(blocks[p // bs]) * bs + p % bs for p in range(context + num_queries)])
    k = pool[0].flatten(0, 1)[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
    v = pool[1].flatten(0, 1)[slots].transpose(0, 1).unsqueeze(0)
    positions = torch.arange(context + num_queries)
    mask = positions.unsqueeze(0) <= (context + torch.arange(num_queries)).unsqueeze(1)
    out = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # fmt: skip
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize(
    "num_queries,context,heads,kv_heads,head_dim,block_size",
    [
        (1, 70, 9, 3, 64, 16),  # one row
        (37, 0, 9, 3, 64, 16),  # no context: only the causal part, several partial tiles
        (100, 300, 9, 3, 64, 16),  # the default model's geometry: items of 32 positions x 3 heads, two row groups
        (40, 61, 14, 2, 24, 32),  # 7 heads a group: 13 positions, 91 rows, the second group padded
        (20, 45, 4, 4, 8, 5),  # no grouping, the smallest head, blocks that split the key tile
        (13, 33, 48, 1, 16, 7),  # 48 query heads on one KV head: one position fills a tile
        (64, 129, 32, 8, 128, 16),  # a Llama-8B layer
        (9, 250, 14, 2, 24, 32),  # D not a multiple of 32: the P . V tail
    ],
)
def test_the_kernel_is_softmax_attention_over_the_blocks(kernels: cpu.CpuKernels, num_queries, context, heads,
                                                          kv_heads, head_dim, block_size):  # fmt: skip
    query, pool, blocks = _scattered_chunk(num_queries, context, heads, kv_heads, head_dim, block_size, seed=num_queries)
    scale = head_dim**-0.5
    if not kernels.has_chunk_attention:  # the plain-C build: refused, never computed
        with pytest.raises(KernelArgumentError, match="not built"):
            kernels.chunk_attention(query, pool[0], pool[1], blocks, context, scale)
        return
    got = kernels.chunk_attention(query, pool[0], pool[1], blocks, context, scale)
    torch.testing.assert_close(got, _reference(query, pool, blocks, context, scale), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named_before_any_read(compiled_kernels: cpu.CpuKernels) -> None:
    if not compiled_kernels.has_chunk_attention:
        pytest.skip("this build has no chunk kernel (no AVX2 + FMA)")
    query, pool, blocks = _scattered_chunk(10, 40, 6, 2, 16, 8, seed=1)
    outside = blocks.clone()
    outside[2] = pool.shape[1]  # one past the pool
    with pytest.raises(KernelArgumentError, match="entry 2"):
        compiled_kernels.chunk_attention(query, pool[0], pool[1], outside, 40, 0.25)
    with pytest.raises(KernelArgumentError, match="cannot hold"):  # 49 positions need 7 blocks of 8
        compiled_kernels.chunk_attention(query, pool[0], pool[1], blocks[:6], 40, 0.25)
    with pytest.raises(KernelArgumentError, match="head_dim 12"):
        odd = torch.randn(2, 8, 8, 2, 12)
        compiled_kernels.chunk_attention(torch.randn(3, 6, 12), odd[0], odd[1], torch.arange(4, dtype=torch.int32), 5, 0.25)
    with pytest.raises(KernelArgumentError, match="blocks"):
        compiled_kernels.chunk_attention(query, pool[0], pool[1], blocks.long(), 40, 0.25)


def test_a_step_whose_chunk_after_context_takes_the_kernel_matches_the_step_without_it(
    compiled_kernels: cpu.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode, a fresh prompt and a 40-token chunk after 70 cached tokens in one step: the chunk
    goes to the kernel (below SDPA's split size), and the step's output and pool equal the step's
    where the kernel is off (the masked SDPA call)."""
    if not compiled_kernels.has_chunk_attention:
        pytest.skip("this build has no chunk kernel (no AVX2 + FMA)")
    heads, kv_heads, head_dim, bs = 6, 2, 16, 8
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(2, 40, bs, kv_heads, head_dim, generator=gen)
    # (query_len, seq_len, block table): a decode, a fresh 9-token prompt, 40 new tokens after 70
    requests = [(1, 13, [5, 9]), (9, 9, [7, 8]), (40, 110, [0, 1, 3, 6, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])]
    slots = [t[p // bs] * bs + p % bs for q_len, seq_len, t in requests for p in range(seq_len - q_len, seq_len)]
    tokens = sum(r[0] for r in requests)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    width = max(len(r[2]) for r in requests)
    common = CommonAttentionInputs.from_lens(
        [r[0] for r in requests], [r[1] for r in requests], slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([r[2] + [0] * (width - len(r[2])) for r in requests], dtype=torch.int32),
        block_size=bs,
    )  # fmt: skip
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(common)
    assert [chunk.kernel is not None for chunk in metadata.chunks] == [False, True]  # the fresh prompt, the chunk
    pool_fast, pool_ref = pool.clone(), pool.clone()
    fast = backend.forward(q, k, v, pool_fast, metadata, 0.25)
    monkeypatch.setattr(torch_backend, "_chunk_kernel", lambda common, compute_dtype: None)
    reference_metadata = backend.build_metadata(common)
    assert all(chunk.kernel is None for chunk in reference_metadata.chunks)
    reference = backend.forward(q, k, v, pool_ref, reference_metadata, 0.25)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool_fast, pool_ref)
