"""The attention backend's fast paths against its reference paths.

- The CPU paged decode kernel (cpu_kernels) against dense SDPA over the same K/V gathered
  by hand, across block sizes, GQA groupings, head sizes (the AVX2 and scalar loops),
  batch sizes below and above the thread count, and scattered block tables.
- The whole backend with the kernel against the backend with it disabled (the padded-gather
  path), on a step that mixes decodes, a fresh prompt (SDPA's causal flag, no pool read)
  and a chunk with cached context.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from servelm.attention import torch_backend
from servelm.attention.backend import CommonAttentionInputs
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.kernels import cpu as cpu_kernels

kernels = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(kernels is None, reason="no C compiler: the kernel cannot be built here")


def _pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)


def _dense_decode(q, pool, tables, lens, scale):
    """Reference: gather each request's K/V in position order and run SDPA on it alone."""
    bs = pool.shape[2]
    outs = []
    for b, n in enumerate(lens):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(n)])
        k = pool[0].reshape(-1, *pool.shape[3:])[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, n, D]
        v = pool[1].reshape(-1, *pool.shape[3:])[slots].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q[b].unsqueeze(0).unsqueeze(2), k, v, scale=scale, enable_gqa=True)
        outs.append(out.squeeze(0).squeeze(1))
    return torch.stack(outs)


@needs_kernel
@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,block_size",
    [(1, 9, 3, 64, 16), (5, 4, 2, 16, 4), (16, 8, 8, 32, 16), (3, 6, 1, 12, 5), (64, 9, 3, 64, 16)],
)
def test_kernel_matches_dense_attention(batch, heads, kv_heads, head_dim, block_size):
    rng = random.Random(batch * 7 + head_dim)
    lens = [rng.randint(1, 70) for _ in range(batch)]
    per_request = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(per_request) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # blocks scattered through the pool, as after churn
    tables, used = [], 0
    for n in per_request:
        tables.append(ids[used : used + n])
        used += n
    pool = _pool(num_blocks, block_size, kv_heads, head_dim, seed=batch)
    q = torch.randn(batch, heads, head_dim, generator=torch.Generator().manual_seed(1))
    width = max(per_request)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    scale = head_dim**-0.5
    got = kernels.decode_attention(q, pool[0], pool[1], table_t, torch.tensor(lens, dtype=torch.int32), max(lens), scale)
    torch.testing.assert_close(got, _dense_decode(q, pool, tables, lens, scale), rtol=1e-5, atol=1e-5)


def _mixed_step(seed: int):
    """A step of 3 decodes, a fresh 9-token prompt and a 6-token chunk after 11 cached tokens."""
    heads, kv_heads, head_dim, block_size = 6, 2, 16, 4
    pool = _pool(32, block_size, kv_heads, head_dim, seed)
    # (query_len, seq_len, block table)
    requests = [(1, 13, [5, 9, 2, 30]), (9, 9, [7, 8, 11]), (1, 1, [4]), (6, 17, [0, 1, 3, 6, 12]), (1, 29, [13, 14, 15, 16, 17, 18, 19, 20])]
    starts, slots = [0], []
    for q_len, seq_len, table in requests:
        starts.append(starts[-1] + q_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    tokens = starts[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    width = max(len(r[2]) for r in requests)
    common = CommonAttentionInputs.from_lens(
        [r[0] for r in requests],
        [r[1] for r in requests],
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([r[2] + [0] * (width - len(r[2])) for r in requests], dtype=torch.int32),
        block_size=block_size,
    )
    return q, k, v, pool, common


@needs_kernel
@pytest.mark.parametrize("all_decodes", [False, True])
def test_backend_with_kernel_matches_backend_without(monkeypatch, all_decodes):
    q, k, v, pool, common = _mixed_step(seed=3)
    if all_decodes:  # keep only the decodes: the kernel's output is returned as is
        keep = [0, 2, 4]
        rows = [int(common.query_start_loc[i]) for i in keep]
        q, k, v = q[rows], k[rows], v[rows]
        common = CommonAttentionInputs.from_lens(
            [1] * len(keep),
            common.seq_lens[keep],
            slot_mapping=common.slot_mapping[rows],
            block_table=common.block_table[keep],
            block_size=common.block_size,
        )
    backend = TorchAttentionBackend()
    pool_fast, pool_ref = pool.clone(), pool.clone()
    fast = backend.forward(q, k, v, pool_fast, backend.build_metadata(common), 0.25)
    monkeypatch.setattr(torch_backend, "_paged_kernel", lambda query, kv_cache: None)
    reference = backend.forward(q, k, v, pool_ref, backend.build_metadata(common), 0.25)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool_fast, pool_ref)  # both wrote the same K/V


def test_fresh_prompt_fast_path_matches_masked_pool_path():
    """A chunk with nothing cached attends to its own K/V with is_causal; the masked pool read agrees."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(23, h, 16, generator=gen) for h in (4, 2, 2))
    fast = torch_backend._attend(q, k, v, 0.25)
    mask = torch_backend._causal_mask(23, 23, q.device)
    reference = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, scale=0.25, enable_gqa=True,
    ).squeeze(0).transpose(0, 1)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
