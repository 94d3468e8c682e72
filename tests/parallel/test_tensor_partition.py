"""The tensor-parallel partition math (servelm.parallel.tensor): every head, MLP column and vocabulary
row is owned exactly once (KV heads: replicated exactly as designed), query heads always sit with
their KV head, and sizes that cannot be split are refused naming them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelm.parallel.tensor import attention_shard, attention_shards, mlp_shards, split_ranges, vocab_shards


def test_the_default_model_at_tp2_splits_its_kv_heads_two_and_one():
    # SmolLM2-135M: 9 heads / 3 KV heads.
    rank0, rank1 = attention_shards(9, 3, 2)
    assert (list(rank0.kv_heads), list(rank0.q_heads)) == ([0, 1], [0, 1, 2, 3, 4, 5])
    assert (list(rank1.kv_heads), list(rank1.q_heads)) == ([2], [6, 7, 8])


def test_more_ranks_than_kv_heads_replicate_each_kv_head_and_split_its_group():
    shards = attention_shards(4, 2, 4)
    assert [list(s.kv_heads) for s in shards] == [[0], [0], [1], [1]]
    assert [list(s.q_heads) for s in shards] == [[0], [1], [2], [3]]
    # 9 heads / 3 KV heads at tp 6: each group of 3 query heads split 2 + 1.
    shards = attention_shards(9, 3, 6)
    assert [list(s.q_heads) for s in shards] == [[0, 1], [2], [3, 4], [5], [6, 7], [8]]
    assert attention_shard(9, 3, 6, 3).kv_heads == range(1, 2)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (9, 3, 4, "tensor_parallel_size 4 cannot split 3 KV heads"),
        (4, 2, 8, "each KV head's 2 query head(s) would be shared by 4 ranks"),
        (4, 1, 8, "each KV head's 4 query head(s) would be shared by 8 ranks"),
        (6, 4, 2, "6 query heads do not form groups over 4 KV heads"),
    ],
)
def test_head_counts_that_cannot_be_split_are_refused_naming_them(heads, kv_heads, tp, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        attention_shards(heads, kv_heads, tp)


def test_splits_that_leave_a_rank_empty_or_cut_an_alignment_are_refused():
    with pytest.raises(
        ValueError, match="cannot split 64 MLP columns over 4 tensor-parallel ranks \\(in multiples of 32\\)"
    ):
        mlp_shards(64, 4, align=32)
    with pytest.raises(ValueError, match="100 MLP columns in multiples of 32"):
        mlp_shards(100, 2, align=32)
    with pytest.raises(ValueError, match="cannot split 3 vocabulary rows over 4"):
        vocab_shards(3, 4)


def test_an_aligned_split_keeps_boundaries_on_blocks_and_gives_the_extra_blocks_first():
    # The default model's MLP: 1536 = 48 blocks of 32; over 5 ranks 10, 10, 10, 9, 9 blocks.
    shards = mlp_shards(1536, 5, align=32)
    assert [len(s) // 32 for s in shards] == [10, 10, 10, 9, 9]
    assert all(s.start % 32 == 0 and s.stop % 32 == 0 for s in shards)


@given(total_units=st.integers(1, 300), parts=st.integers(1, 16), align=st.sampled_from([1, 2, 32]))
def test_split_ranges_covers_every_item_once_in_order_with_balanced_aligned_sizes(total_units, parts, align):
    total = total_units * align
    if total_units < parts:
        with pytest.raises(ValueError):
            split_ranges(total, parts, align=align)
        return
    ranges = split_ranges(total, parts, align=align)
    assert len(ranges) == parts
    assert [i for r in ranges for i in r] == list(range(total))  # each once, contiguous, rank order
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= align and max(sizes) - min(sizes) <= align
    assert sizes == sorted(sizes, reverse=True)
    assert all(r.start % align == 0 for r in ranges)


@given(kv_heads=st.integers(1, 12), group=st.integers(1, 8), tp=st.integers(1, 32))
def test_attention_shards_own_every_query_head_once_beside_its_kv_head(kv_heads, group, tp):
    heads = kv_heads * group
    try:
        shards = attention_shards(heads, kv_heads, tp)
    except ValueError:
        # Refused exactly when the rule cannot place them: more ranks than KV heads, and either
        # not a multiple of them or more sharers of a KV head than its group has query heads.
        assert tp > kv_heads and (tp % kv_heads != 0 or group < tp // kv_heads)
        return
    assert len(shards) == tp
    assert sorted(h for s in shards for h in s.q_heads) == list(range(heads))  # each query head once
    for s in shards:
        assert s.num_heads >= 1 and s.num_kv_heads >= 1
        # Each query head's KV head (its group) is one this rank holds, and the rank's query heads are
        # its KV heads' groups in order, so local head i uses local KV head i // (local group size).
        assert all(h // group in s.kv_heads for h in s.q_heads)
        assert s.num_heads % s.num_kv_heads == 0
        local_group = s.num_heads // s.num_kv_heads
        assert all((h // group) - s.kv_heads.start == i // local_group for i, h in enumerate(s.q_heads))
    holders = [sum(kv in s.kv_heads for s in shards) for kv in range(kv_heads)]
    if tp <= kv_heads:
        assert holders == [1] * kv_heads  # split, never replicated
    else:
        assert holders == [tp // kv_heads] * kv_heads  # replicated equally
