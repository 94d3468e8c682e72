"""The torch backend over a paged pool against a dense, non-paged reference.

Each request has a full K/V history; the part before this step's chunk is written into
scattered pool blocks beforehand (cached context, e.g. a prefix hit), the chunk's own
K/V go through `forward`. The reference attends each request's queries to its history
in position order with an explicit causal softmax, no pool and no SDPA involved.
Batches: decode-only, prefill-only (fresh prompts), mixed, and chunks after cached
context; each with the CPU paged kernel and with the SDPA gather path.
"""

from __future__ import annotations

import random

import pytest
import torch

from servelm.attention import torch_backend
from servelm.attention.backend import CommonAttentionInputs
from servelm.attention.torch_backend import GatherDecodes, KernelDecodes, TorchAttentionBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, SCALE = 6, 2, 16, 4, 0.3

# (query_len, seq_len) per request, in batch order
BATCHES = {
    "decode_only": [(1, 13), (1, 1), (1, 29), (1, 8)],
    "prefill_only": [(9, 9), (1, 1), (17, 17)],
    "mixed": [(1, 13), (9, 9), (1, 1), (6, 17), (1, 29)],
    "prefix_cached_chunks": [(6, 17), (3, 35), (12, 12), (1, 40)],
}


def _dense_reference(q, history_k, history_v, q_len):
    """q: [q_len, H, D] at the last q_len positions of history [seq_len, KVH, D] → [q_len, H, D]."""
    seq_len = history_k.shape[0]
    group = HEADS // KV_HEADS
    k = history_k.double().repeat_interleave(group, dim=1)  # [seq_len, H, D]
    v = history_v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE  # [H, q_len, seq_len]
    query_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def _step(requests, seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for _, s in requests]
    num_blocks = sum(blocks_per_request) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered through the pool, as after churn
    width = max(blocks_per_request)
    tables = [[free.pop() for _ in range(n)] + [0] * (width - n) for n in blocks_per_request]
    pool = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)  # garbage where unwritten
    histories, queries, slots = [], [], []
    for (q_len, seq_len), table in zip(requests, tables):
        k = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=gen)
        request_slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        cached = seq_len - q_len
        flat = pool.view(2, -1, KV_HEADS, HEAD_DIM)
        flat[0, request_slots[:cached]], flat[1, request_slots[:cached]] = k[:cached], v[:cached]
        histories.append((k, v))
        queries.append(torch.randn(q_len, HEADS, HEAD_DIM, generator=gen))
        slots += request_slots[cached:]
    common = CommonAttentionInputs.from_lens(
        [q for q, _ in requests],
        [s for _, s in requests],
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor(tables, dtype=torch.int32),
        block_size=BLOCK_SIZE,
    )
    q = torch.cat(queries)
    k = torch.cat([h[0][s - n :] for h, (n, s) in zip(histories, requests)])
    v = torch.cat([h[1][s - n :] for h, (n, s) in zip(histories, requests)])
    expected = torch.cat([_dense_reference(qr, hk, hv, n) for qr, (hk, hv), (n, _) in zip(queries, histories, requests)])
    return q, k, v, pool, common, expected


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_backend_equals_dense_reference(monkeypatch, batch, use_kernel):
    if not use_kernel:
        monkeypatch.setattr(torch_backend, "_paged_kernel", lambda device, dtype: None)
    elif torch_backend._paged_kernel(torch.device("cpu"), torch.float32) is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    requests = BATCHES[batch]
    q, k, v, pool, common, expected = _step(requests, seed=len(batch))
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(common)

    num_decodes = sum(1 for n, _ in requests if n == 1)
    expected_path = KernelDecodes if use_kernel else GatherDecodes
    if use_kernel or num_decodes > 1:
        assert isinstance(metadata.decodes, expected_path)
        assert len(metadata.chunks) == len(requests) - num_decodes
    else:  # a lone decode without the kernel rides with the chunks
        assert metadata.decodes is None and len(metadata.chunks) == len(requests)
    assert [c.context_slots is None for c in metadata.chunks] == [
        n == s for n, s in requests if metadata.decodes is None or n != 1
    ]

    out = backend.forward(q, k, v, pool, metadata, SCALE)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    again = backend.forward(q, k, v, pool, metadata, SCALE)  # a second layer reads the same metadata
    assert torch.equal(out, again)


def test_no_pool_forward_attends_each_prompt_alone():
    requests = [(5, 5), (1, 1), (11, 11)]
    q, k, v, _, _, expected = _step(requests, seed=9)
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(CommonAttentionInputs.for_prompts([5, 1, 11]))
    assert metadata.slot_mapping is None and metadata.decodes is None
    torch.testing.assert_close(backend.forward(q, k, v, None, metadata, SCALE), expected, rtol=1e-5, atol=1e-5)


def test_inconsistent_inputs_raise():
    with pytest.raises(ValueError, match="query_len"):
        CommonAttentionInputs.for_prompts([3, 0])
    with pytest.raises(ValueError, match="one slot per new token"):
        CommonAttentionInputs.from_lens(
            [2], [5], slot_mapping=torch.tensor([1]), block_table=torch.zeros(1, 2, dtype=torch.int32), block_size=4
        )
    with pytest.raises(ValueError, match="give both"):
        CommonAttentionInputs.from_lens([2], [5], slot_mapping=torch.tensor([1, 2]), block_table=None, block_size=4)
    no_pool_with_context = CommonAttentionInputs.from_lens([2], [5], slot_mapping=None, block_table=None, block_size=0)
    with pytest.raises(ValueError, match="needs a KV pool"):
        TorchAttentionBackend().build_metadata(no_pool_with_context)
