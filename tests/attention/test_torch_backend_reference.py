"""The torch backend over a paged pool against a dense, non-paged reference.

Each request has a full K/V history; the part before this step's chunk is written into
scattered pool blocks beforehand (cached context, e.g. a prefix hit), the chunk's own
K/V go through `forward`. The reference attends each request's queries to its history
in position order with an explicit causal softmax, no pool and no SDPA involved.
Batches: decode-only, prefill-only (fresh prompts), mixed, chunks after cached context,
and short queries after cached context (speculative verification, attended as decode
rows) among decodes and chunks; each with the CPU paged kernel and with the SDPA gather
path, over several block sizes.
"""

from __future__ import annotations

import random

import pytest
import torch

from servelm.attention import torch_backend
from servelm.attention.backend import CommonAttentionInputs
from servelm.attention.torch_backend import (
    SHORT_QUERY_MAX,
    SPLIT_ATTENTION_MIN_QUERIES,
    GatherDecodes,
    KernelDecodes,
    TorchAttentionBackend,
)

HEADS, KV_HEADS, HEAD_DIM, SCALE = 6, 2, 16, 0.3

# (query_len, seq_len) per request, in batch order
BATCHES = {
    "decode_only": [(1, 13), (1, 1), (1, 29), (1, 8)],
    "prefill_only": [(9, 9), (1, 1), (17, 17)],
    "mixed": [(1, 13), (9, 9), (1, 1), (6, 17), (1, 29)],
    "prefix_cached_chunks": [(6, 17), (3, 35), (12, 12), (1, 40)],
    # 1 + k tokens after context (k up to 15), with decodes, a fresh short prompt (stays a chunk)
    # and queries just past the short-query bound (chunks)
    "spec_verify_mixed": [(3, 40), (1, 13), (9, 60), (2, 2), (SHORT_QUERY_MAX, 33), (1, 1), (SHORT_QUERY_MAX + 1, 50)],
    "spec_verify_only": [(2, 30), (5, 21), (SHORT_QUERY_MAX, SHORT_QUERY_MAX + 1), (1, 7), (8, 64)],
    "spec_verify_lone": [(6, 45)],
    # long chunks after context (two flash calls merged) beside one just under the bound (one
    # masked call), a decode and a fresh prompt
    "long_chunks_after_context": [
        (SPLIT_ATTENTION_MIN_QUERIES, 300),
        (1, 20),
        (SPLIT_ATTENTION_MIN_QUERIES + 37, 450),
        (SPLIT_ATTENTION_MIN_QUERIES - 1, 270),
        (40, 40),
    ],
}


def _is_decode_row(query_len: int, seq_len: int) -> bool:
    """Whether a request's tokens are attended as decode rows (a decode, or a short query after context)."""
    return query_len == 1 or (query_len <= SHORT_QUERY_MAX and seq_len > query_len)


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


def _step(requests, seed: int, block_size: int = 4):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = [(s + block_size - 1) // block_size for _, s in requests]
    num_blocks = sum(blocks_per_request) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered through the pool, as after churn
    width = max(blocks_per_request)
    tables = [[free.pop() for _ in range(n)] + [0] * (width - n) for n in blocks_per_request]
    pool = torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen)  # garbage where unwritten
    histories, queries, slots = [], [], []
    for (q_len, seq_len), table in zip(requests, tables):
        k = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=gen)
        request_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
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
        block_size=block_size,
    )
    q = torch.cat(queries)
    k = torch.cat([h[0][s - n :] for h, (n, s) in zip(histories, requests)])
    v = torch.cat([h[1][s - n :] for h, (n, s) in zip(histories, requests)])
    expected = torch.cat([_dense_reference(qr, hk, hv, n) for qr, (hk, hv), (n, _) in zip(queries, histories, requests)])
    return q, k, v, pool, common, expected


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_backend_equals_dense_reference(monkeypatch, batch, use_kernel, block_size):
    if not use_kernel:  # neither compiled kernel: the decode rows gathered, the chunks after context by SDPA
        monkeypatch.setattr(torch_backend, "_paged_kernel", lambda device, dtype: None)
        monkeypatch.setattr(torch_backend, "_chunk_kernel", lambda common, compute_dtype: None)
    elif torch_backend._paged_kernel(torch.device("cpu"), torch.float32) is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    requests = BATCHES[batch]
    q, k, v, pool, common, expected = _step(requests, seed=len(batch), block_size=block_size)
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(common)

    as_rows = [_is_decode_row(n, s) for n, s in requests]
    expected_path = KernelDecodes if use_kernel else GatherDecodes
    if use_kernel or sum(as_rows) > 1:
        assert isinstance(metadata.decodes, expected_path)
        starts = common.query_start_loc.tolist()
        token_rows = [t for i, row in enumerate(as_rows) if row for t in range(starts[i], starts[i + 1])]
        assert metadata.decodes.rows.tolist() == token_rows  # a request's rows adjacent, in batch order
        assert metadata.decodes.covers_batch == (len(token_rows) == common.num_tokens)
    else:  # a lone request without the kernel rides with the chunks
        as_rows = [False] * len(requests)
        assert metadata.decodes is None
    chunked = [r for r, row in zip(requests, as_rows) if not row]
    assert [(c.end - c.start, c.context_blocks is None) for c in metadata.chunks] == [(n, n == s) for n, s in chunked]

    for chunk in metadata.chunks:  # one call attends queries after context: the chunk kernel, or SDPA with a mask
        one_call = chunk.context_blocks is not None and chunk.end - chunk.start < SPLIT_ATTENTION_MIN_QUERIES
        if chunk.kernel is not None:
            assert use_kernel and one_call and chunk.context_mask is None
        else:
            assert (chunk.context_mask is not None) == (one_call and chunk.end - chunk.start > 1)

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
