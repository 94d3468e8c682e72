"""The Triton kernels (servelm.kernels.triton) against a float64 reference, under Triton's
interpreter on CPU (tests/conftest.py turns it on before triton defines a kernel).

Pools are random, block tables ragged (shuffled, non-contiguous block ids), block sizes include
one that is not a power of two, GQA groups of 2, 3 and 8 query heads, float32 and bfloat16.
The interpreter runs one program at a time, so shapes stay small.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from servelm.attention.kv_storage import QuantizedKV, dequantize
from servelm.attention.kv_storage import write_kv as torch_write_kv
from servelm.kernels.triton.decode_attention import MAX_SPLITS, choose_num_splits, paged_decode_attention
from servelm.kernels.triton.kv_write import write_kv
from servelm.kernels.triton.pool import KVPool
from servelm.kernels.triton.prefill_attention import BLOCK_Q, fresh_kv, paged_prefill_attention, plan_tiles

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)",
)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


class PagedCase:
    """A pool of random K/V and per-request block tables over shuffled block ids."""

    def __init__(self, seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, seed: int) -> None:  # fmt: skip
        self.generator = torch.Generator().manual_seed(seed)
        self.block_size, self.dtype = block_size, dtype
        blocks_per_request = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_request) + 3  # some blocks belong to nobody
        self.pool_tensor = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=self.generator)
        self.pool_tensor = self.pool_tensor.to(dtype)
        ids = torch.randperm(num_blocks, generator=self.generator)
        width = max(blocks_per_request)
        self.block_table = torch.zeros(len(seq_lens), width + 1, dtype=torch.int32)  # a spare column
        taken = 0
        for i, n in enumerate(blocks_per_request):
            self.block_table[i, :n] = ids[taken : taken + n]
            taken += n
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)

    @property
    def pool(self) -> KVPool:
        return KVPool(self.pool_tensor[0], self.pool_tensor[1])

    def slots(self, request: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return self.block_table[request, positions // bs].long() * bs + positions % bs

    def dense_kv(self, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of request's positions 0..seq_len-1: [seq_len, KVH, D] float64 each."""
        slots = self.slots(request, torch.arange(int(self.seq_lens[request])))
        flat = self.pool_tensor.flatten(1, 2)  # [2, slots, KVH, D]
        return flat[0, slots].double(), flat[1, slots].double()


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """query [q, H, D] at the last q positions of key/value [S, KVH, D]; causal; float64 [q, H, D]."""
    q_len, num_heads = query.shape[:2]
    group = num_heads // key.shape[1]
    k = key.double().repeat_interleave(group, 1)
    v = value.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    context = key.shape[0] - q_len
    visible = torch.arange(key.shape[0])[None, :] <= (context + torch.arange(q_len))[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    error = (actual.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error} > {TOLERANCE[dtype]}"


# -- KV write ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "block_size"), [(torch.float32, 16), (torch.bfloat16, 12)])
def test_write_stores_every_token_at_its_slot_and_nothing_else(dtype, block_size):
    g = torch.Generator().manual_seed(1)
    num_blocks, kv_heads, head_dim = 6, 3, 24  # head_dim not a power of two: masked columns
    pool_tensor = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    expected = pool_tensor.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:37]  # 37 tokens: tiles with a ragged tail
    key = torch.randn(37, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(37, kv_heads, head_dim, generator=g).to(dtype)
    torch_write_kv(expected, key, value, slots)
    write_kv(key, value, KVPool(pool_tensor[0], pool_tensor[1]), slots)
    assert torch.equal(pool_tensor, expected)


def test_write_takes_strided_key_and_value_views():
    """K and V as the model hands them: column slices of one projection output."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, (4 + 2 + 2) * 8, generator=g)
    key = qkv[:, 32:48].view(5, 2, 8)
    value = qkv[:, 48:].view(5, 2, 8)
    pool_tensor, expected = torch.zeros(2, 2, 4, 2, 8), torch.zeros(2, 2, 4, 2, 8)
    slots = torch.tensor([7, 0, 3, 4, 5])
    torch_write_kv(expected, key, value, slots)
    write_kv(key, value, KVPool(pool_tensor[0], pool_tensor[1]), slots)
    assert torch.equal(pool_tensor, expected)


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_write_equals_the_torch_path_bit_for_bit(code_dtype):
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim = 4, 8, 2, 16
    pools = [
        QuantizedKV(torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=code_dtype),
                    torch.zeros(2, num_blocks, block_size, kv_heads))
        for _ in range(2)
    ]  # fmt: skip
    key = torch.randn(11, kv_heads, head_dim, generator=g) * 3
    value = torch.randn(11, kv_heads, head_dim, generator=g)
    # Ties for int8's rounding: absmax 127 gives scale 1, so these codes are exactly k + 0.5.
    key[0, 0] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5] * 2)
    value[1, 1] = 0.0  # an all-zero head: the smallest scale, zero codes
    slots = torch.randperm(num_blocks * block_size, generator=g)[:11]
    torch_write_kv(pools[0], key, value, slots)
    pool = KVPool(pools[1].data[0], pools[1].data[1], pools[1].scales[0], pools[1].scales[1])
    write_kv(key, value, pool, slots)
    assert torch.equal(pools[1].scales, pools[0].scales)
    assert torch.equal(pools[1].data.view(torch.uint8), pools[0].data.view(torch.uint8))


# -- decode ------------------------------------------------------------------------------------

DECODE_CASES = [
    # heads, kv_heads, head_dim, block_size, dtype, seq_lens, num_splits
    (4, 2, 32, 16, torch.float32, [1, 37, 64, 130], 1),
    (9, 3, 24, 12, torch.float32, [200, 1, 77], 4),  # not a power of two: head_dim, block and group
    (8, 1, 32, 32, torch.bfloat16, [90, 3], 2),
    (4, 2, 32, 8, torch.bfloat16, [300, 17], 8),  # more splits than some rows have tiles: empty splits
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype", "seq_lens", "num_splits"), DECODE_CASES
)
def test_decode_matches_reference(heads, kv_heads, head_dim, block_size, dtype, seq_lens, num_splits):
    case = PagedCase(seq_lens, block_size, kv_heads, head_dim, dtype, seed=len(seq_lens) + heads)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=case.generator).to(dtype)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(out, query, case.pool, case.block_table, case.seq_lens, 0.3, num_splits=num_splits)
    for r in range(len(seq_lens)):
        key, value = case.dense_kv(r)
        _assert_close(out[r], reference_attention(query[r : r + 1], key, value, 0.3)[0], dtype)


def test_indexed_decode_rows_write_only_their_tokens():
    """Decodes mixed into a batch: row i is request requests[i] at batch row token_rows[i]; the
    other rows of the output keep what they held."""
    case = PagedCase([40, 9, 23, 70], 16, 2, 16, torch.float32, seed=5)
    query = torch.randn(10, 4, 16, generator=case.generator)
    requests = torch.tensor([1, 3], dtype=torch.int32)
    token_rows = torch.tensor([4, 9], dtype=torch.int32)
    out = torch.full_like(query, 7.0)
    paged_decode_attention(out, query, case.pool, case.block_table, case.seq_lens, 0.25, requests=requests,
                           token_rows=token_rows, num_splits=2)  # fmt: skip
    for request, row in ((1, 4), (3, 9)):
        key, value = case.dense_kv(request)
        _assert_close(out[row], reference_attention(query[row : row + 1], key, value, 0.25)[0], torch.float32)
    untouched = [r for r in range(10) if r not in (4, 9)]
    assert bool((out[untouched] == 7.0).all())


def test_decode_reads_int8_codes_through_their_scales():
    case = PagedCase([50, 5], 16, 2, 16, torch.float32, seed=6)
    codes = torch.randint(-127, 128, case.pool_tensor.shape, generator=case.generator, dtype=torch.int8)
    scales = torch.rand(case.pool_tensor.shape[:-1], generator=case.generator) / 50
    case.pool_tensor = dequantize(codes, scales, torch.float32)  # what the reference reads
    pool = KVPool(codes[0], codes[1], scales[0], scales[1])
    query = torch.randn(2, 4, 16, generator=case.generator)
    out = torch.empty_like(query)
    paged_decode_attention(out, query, pool, case.block_table, case.seq_lens, 0.25)
    for r in range(2):
        key, value = case.dense_kv(r)
        _assert_close(out[r], reference_attention(query[r : r + 1], key, value, 0.25)[0], torch.float32)


def test_split_choice_fills_the_device_and_keeps_splits_long():
    assert choose_num_splits(num_rows=1, num_kv_heads=8, max_context=32768, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(num_rows=1, num_kv_heads=8, max_context=600, num_sms=132) == 2  # 256+ keys each
    assert choose_num_splits(num_rows=256, num_kv_heads=8, max_context=32768, num_sms=132) == 1  # device full
    assert choose_num_splits(num_rows=4, num_kv_heads=2, max_context=8192, num_sms=132) == 16
    assert choose_num_splits(num_rows=3, num_kv_heads=1, max_context=100, num_sms=132) == 1


# -- prefill -----------------------------------------------------------------------------------

PREFILL_CASES = [
    # heads, kv_heads, head_dim, block_size, dtype, (context, query_len) per request
    (4, 2, 32, 16, torch.float32, [(0, 37), (20, 5), (33, 1)]),  # a fresh prompt, a chunk after a prefix, 1 token
    (9, 3, 24, 12, torch.float32, [(17, 20), (0, 3)]),
    (8, 1, 32, 32, torch.bfloat16, [(40, 18), (0, 1)]),  # 8 heads per KV head: the widest tile
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "dtype", "chunks"), PREFILL_CASES)
def test_prefill_after_cached_context_matches_reference(heads, kv_heads, head_dim, block_size, dtype, chunks):
    case = PagedCase([c + q for c, q in chunks], block_size, kv_heads, head_dim, dtype, seed=heads + block_size)
    query_lens = torch.tensor([q for _, q in chunks], dtype=torch.int32)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(query_lens, 0, dtype=torch.int32)])
    query = torch.randn(int(query_lens.sum()), heads, head_dim, generator=case.generator).to(dtype)
    tile_requests, tile_starts = plan_tiles(query_lens, torch.arange(len(chunks)))
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(out, query, case.pool, case.block_table, query_start_loc, case.seq_lens, tile_requests,
                            tile_starts, 0.2)  # fmt: skip
    for r in range(len(chunks)):
        s, e = int(query_start_loc[r]), int(query_start_loc[r + 1])
        key, value = case.dense_kv(r)
        _assert_close(out[s:e], reference_attention(query[s:e], key, value, 0.2), dtype)


def test_prefill_without_a_pool_attends_to_the_fresh_key_values():
    g = torch.Generator().manual_seed(8)
    query_lens = torch.tensor([19, 1, 6], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 19, 20, 26], dtype=torch.int32)
    query = torch.randn(26, 9, 16, generator=g)
    key, value = torch.randn(26, 3, 16, generator=g), torch.randn(26, 3, 16, generator=g)
    tile_requests, tile_starts = plan_tiles(query_lens, torch.arange(3))
    out = torch.empty_like(query)
    paged_prefill_attention(out, query, fresh_kv(key, value), None, query_start_loc, query_lens, tile_requests,
                            tile_starts, 0.25)  # fmt: skip
    for r in range(3):
        s, e = int(query_start_loc[r]), int(query_start_loc[r + 1])
        _assert_close(out[s:e], reference_attention(query[s:e], key[s:e], value[s:e], 0.25), torch.float32)


def test_tiles_cover_each_chunk_in_block_q_steps():
    query_lens = torch.tensor([BLOCK_Q * 2 + 1, 1, 5, BLOCK_Q])
    tile_requests, tile_starts = plan_tiles(query_lens, torch.tensor([0, 2, 3]))  # request 1 is a decode
    assert tile_requests.tolist() == [0, 0, 0, 2, 3]
    assert tile_starts.tolist() == [0, BLOCK_Q, 2 * BLOCK_Q, 0, 0]
