"""Partial attention, its log-sum-exp merge and ring attention against dense softmax attention.

- partial_attention + merge_partials over keys cut into parts at random points, each query
  seeing a random prefix of the keys (some none at all), GQA; the reference is an explicit
  float64 masked softmax. Both paths: torch's CPU flash kernel and the plain math.
- ring_attention on 2 and 3 real ranks (gloo), positions dealt to ranks at random (uneven
  shards, a rank with no keys, a rank with no queries) against dense causal attention.
- The row exchanges under it (uneven counts, zero counts, bf16 and fp8 as bytes).
"""

from __future__ import annotations

import pytest
import torch

from servelm.parallel import partial_attention as partial_attention_module
from servelm.parallel.exchange import all_gather_rows, all_to_all_rows
from servelm.parallel.groups import ParallelGroups, ParallelLayout, all_gather_last_dim
from servelm.parallel.partial_attention import (
    causal_partial_attention,
    merge_partials,
    merge_partials_with_lse,
    padded_partial_attention,
    partial_attention,
)
from servelm.parallel.ring import ring_attention
from servelm.testing.ranks import run_ranks

HEADS, KV_HEADS, HEAD_DIM, SCALE = 6, 2, 8, 0.35


def _dense(q, k, v, key_limits, scale=SCALE):
    """Explicit float64 softmax: query i over keys [0, key_limits[i]); a query that sees none gives 0."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)  # [Tk, H, D]
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    hidden = torch.arange(k.shape[0]).unsqueeze(0) >= key_limits.unsqueeze(1)  # [Tq, Tk]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)  # [Tq, H]
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return torch.einsum("hqk,khd->qhd", probs, v64).float(), lse.float()


def _qkv(num_queries: int, num_keys: int, seed: int, heads: int = HEADS, kv_heads: int = KV_HEADS):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, heads, HEAD_DIM, generator=gen)
    k = torch.randn(num_keys, kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(num_keys, kv_heads, HEAD_DIM, generator=gen)
    return q, k, v, gen


@pytest.fixture(params=["flash_cpu", "math"])
def kernel(request, monkeypatch):
    """Each test of the math runs on both paths: torch's CPU flash kernel and the plain float32 math."""
    if request.param == "math":
        monkeypatch.setattr(partial_attention_module, "_FLASH_CPU_DTYPES", ())
    else:  # the kernel for every part, however few its queries
        monkeypatch.setattr(partial_attention_module, "FLASH_MIN_QUERIES", 1)
    return request.param


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("num_parts", [1, 2, 5])
def test_partials_merge_to_dense_softmax(kernel, heads, kv_heads, num_parts):
    q, k, v, gen = _qkv(23, 40, seed=num_parts * 10 + heads, heads=heads, kv_heads=kv_heads)
    limits = torch.randint(0, 41, (23,), generator=gen)
    limits[:3] = 0  # fully masked queries
    cuts = sorted(torch.randint(0, 41, (num_parts - 1,), generator=gen).tolist())
    bounds = list(zip([0, *cuts], [*cuts, 40]))
    outs, lses = [], []
    for a, b in bounds:  # part [a, b): query i sees its keys below limits[i]
        out, lse = partial_attention(q, k[a:b], v[a:b], (limits - a).clamp(0, b - a), SCALE)
        outs.append(out)
        lses.append(lse)
    expected, expected_lse = _dense(q, k, v, limits)
    merged, merged_lse = merge_partials_with_lse(outs, lses)
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse, expected_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(merged[:3], torch.zeros_like(merged[:3]))
    assert bool(torch.isneginf(merged_lse[:3]).all()) and not bool(merged.isnan().any())


def test_one_part_is_the_dense_softmax_with_its_lse(kernel):
    q, k, v, gen = _qkv(9, 17, seed=3)
    limits = torch.randint(0, 18, (9,), generator=gen)
    out, lse = partial_attention(q, k, v, limits, SCALE)
    expected, expected_lse = _dense(q, k, v, limits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_queries,num_keys,first_limit",
    [(20, 20, 1), (20, 21, 0), (20, 30, 11), (20, 25, 7), (5, 9, 9), (1, 4, 0), (6, 3, 2)],
)
def test_causal_partials_equal_their_key_limits(kernel, num_queries, num_keys, first_limit):
    """Limits that grow by one per query (the ring's shape): the kernel's two maskless calls, merged."""
    q, k, v, _ = _qkv(num_queries, num_keys, seed=num_keys + first_limit)
    limits = (torch.arange(num_queries) + first_limit).clamp(max=num_keys)
    out, lse = causal_partial_attention(q, k, v, first_limit, SCALE)
    expected, expected_lse = _dense(q, k, v, limits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


def test_padded_batch_equals_each_request_alone(kernel):
    q, k, v, gen = _qkv(3 * 4, 3 * 11, seed=5)
    q, k, v = q.view(3, 4, HEADS, HEAD_DIM), k.view(3, 11, KV_HEADS, HEAD_DIM), v.view(3, 11, KV_HEADS, HEAD_DIM)
    limits = torch.randint(0, 12, (3, 4), generator=gen)
    out, lse = padded_partial_attention(q, k, v, limits, SCALE)
    for b in range(3):
        alone, alone_lse = partial_attention(q[b], k[b], v[b], limits[b], SCALE)
        torch.testing.assert_close(out[b], alone)
        torch.testing.assert_close(lse[b], alone_lse)


def test_long_queries_are_tiled_like_one_band(kernel, monkeypatch):
    q, k, v, gen = _qkv(37, 29, seed=8)
    limits = torch.randint(0, 30, (37,), generator=gen)
    limits[10:15] = 0  # a band that sees nothing
    whole = partial_attention(q, k, v, limits, SCALE)
    monkeypatch.setattr(partial_attention_module, "SCORE_TILE_BYTES", 4 * HEADS * 29 * 5)  # bands of 5 queries
    banded = partial_attention(q, k, v, limits, SCALE)
    torch.testing.assert_close(banded[0], whole[0])
    torch.testing.assert_close(banded[1], whole[1])


def test_merge_of_empty_parts_is_zero_not_nan(kernel):
    out = torch.randn(4, HEADS, HEAD_DIM)
    empty = torch.full((4, HEADS), float("-inf"))
    merged, lse = merge_partials_with_lse([out, out * 2], [empty, empty])
    assert torch.equal(merged, torch.zeros_like(merged)) and bool(torch.isneginf(lse).all())
    q, k, v, _ = _qkv(4, 0, seed=1)
    none_out, none_lse = partial_attention(q, k, v, torch.zeros(4, dtype=torch.long), SCALE)
    assert torch.equal(none_out, torch.zeros_like(none_out)) and bool(torch.isneginf(none_lse).all())
    finite = torch.zeros(4, HEADS)
    assert torch.equal(merge_partials([out, none_out], [finite, none_lse]), out)  # an empty part weighs nothing


# -- real ranks --------------------------------------------------------------------------

# (context, chunk): the queries are positions [context, context + chunk) of a sequence of that
# many keys; positions are dealt to ranks at random, so shards are uneven.
RING_CASES = [(0, 29), (13, 6), (40, 1), (0, 2)]


def _deal(seq_len: int, world: int, seed: int) -> torch.Tensor:
    """[seq_len] rank of each position, at random; rank world-1 gets nothing in some cases."""
    gen = torch.Generator().manual_seed(seed)
    owners = torch.randint(0, world, (seq_len,), generator=gen)
    if seed % 2:
        owners = owners.clamp(max=max(world - 2, 0))  # the last rank holds no keys and no queries
    return owners


def _ring_rank(groups: ParallelGroups) -> dict:
    cp = groups.cp
    results: dict = {"ring": []}
    for case, (context, chunk) in enumerate(RING_CASES):
        seq_len = context + chunk
        q, k, v, _ = _qkv(seq_len, seq_len, seed=case)  # queries for every position; the chunk's are used
        owners = _deal(seq_len, cp.size, seed=case)
        mine = torch.nonzero(owners == cp.rank).flatten()
        my_queries = mine[mine >= context]
        out = ring_attention(q[my_queries], my_queries, k[mine], v[mine], mine, cp, SCALE)
        results["ring"].append((my_queries, out))
    # Row exchanges: rank r sends r + s rows to rank s (rank 0 sends rank 0 nothing).
    counts = [r + 1 for r in range(cp.size)]
    counts[-1] = 0  # a rank with no rows
    rows = torch.arange(counts[cp.rank] * 3, dtype=torch.float32).view(-1, 3) + 100 * cp.rank
    results["gathered"] = all_gather_rows(rows.to(torch.bfloat16), cp, counts).float()
    sends = [cp.rank + s for s in range(cp.size)]
    recvs = [r + cp.rank for r in range(cp.size)]
    payload = torch.cat([torch.full((n, 2), float(10 * cp.rank + s)) for s, n in enumerate(sends)])
    results["exchanged"] = all_to_all_rows(payload.to(torch.float8_e4m3fn), cp, sends, recvs, any_rows=True).float()
    sizes = [2 + r for r in range(cp.size)]
    results["last_dim"] = all_gather_last_dim(torch.full((2, sizes[cp.rank]), float(cp.rank)), cp, sizes)
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2_ranks", "3_ranks"])
def ring_run(request):
    world = request.param
    return world, run_ranks(_ring_rank, ParallelLayout(context_parallel_size=world), timeout_s=120)


def test_ring_attention_equals_dense_causal_attention(ring_run):
    world, results = ring_run
    for case, (context, chunk) in enumerate(RING_CASES):
        seq_len = context + chunk
        q, k, v, _ = _qkv(seq_len, seq_len, seed=case)
        expected, _ = _dense(q, k, v, torch.arange(seq_len) + 1)  # position p sees keys 0..p
        covered = []
        for rank_queries, out in (r["ring"][case] for r in results):
            torch.testing.assert_close(out, expected[rank_queries], rtol=1e-5, atol=1e-5)
            covered += rank_queries.tolist()
        assert sorted(covered) == list(range(context, seq_len))


def test_row_exchanges_with_uneven_and_empty_counts(ring_run):
    world, results = ring_run
    counts = [r + 1 for r in range(world)]
    counts[-1] = 0
    expected_gather = torch.cat(
        [torch.arange(n * 3, dtype=torch.float32).view(-1, 3) + 100 * r for r, n in enumerate(counts)]
    )
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], expected_gather)
        expected = torch.cat([torch.full((r + rank, 2), float(10 * r + rank)) for r in range(world)])
        assert torch.equal(result["exchanged"], expected.to(torch.float8_e4m3fn).float())  # fp8 bytes, unchanged
        sizes = [2 + r for r in range(world)]
        assert torch.equal(
            result["last_dim"], torch.cat([torch.full((2, n), float(r)) for r, n in enumerate(sizes)], 1)
        )
