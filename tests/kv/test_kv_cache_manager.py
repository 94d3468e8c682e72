"""KVCacheManager on hand-written sequences: exact block ids, refcounts, queue order, counters."""

import pytest

from servelm.kv import KVCacheInvariantError, KVCacheManager, KVEventType, hash_block_tokens


def queue_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def refcounts(kv: KVCacheManager) -> list[int]:
    return [b.ref_count for b in kv.pool.blocks]


def admit(kv: KVCacheManager, request_id: str, tokens: list[int], extra_key: bytes | None = None) -> list[int] | None:
    """Look up, allocate the whole remainder, compute it, cache what became full."""
    hit = kv.get_computed_blocks(request_id, tokens, extra_key)
    new_ids = kv.allocate_slots(
        request_id, len(tokens) - hit.num_computed_tokens, num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit
    )
    if new_ids is not None:
        kv.cache_full_blocks(request_id, tokens, len(tokens))
    kv.check_invariants()
    return new_ids


def test_shared_prefix_refcounts_and_reverse_free_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = list(range(10))
    assert admit(kv, "a", a) == [0, 1, 2]
    assert queue_ids(kv) == [3, 4, 5, 6, 7]
    b = a[:8] + [100, 101, 102]
    hit = kv.get_computed_blocks("b", b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_computed_tokens == 8
    assert admit(kv, "b", b) == [0, 1, 3]
    assert refcounts(kv) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert kv.stats.num_queried_tokens == 21 and kv.stats.num_hit_tokens == 8
    kv.free("a")
    # a's partial block 2 has no hash: to the head. Blocks 0, 1 are still held by b.
    assert queue_ids(kv) == [2, 4, 5, 6, 7]
    assert refcounts(kv) == [1, 1, 0, 1, 0, 0, 0, 0]
    kv.free("b")
    # Reverse order: 3 (partial) to the head, then 1 before 0 at the tail, so the
    # prefix's first block is evicted last.
    assert queue_ids(kv) == [3, 2, 4, 5, 6, 7, 1, 0]
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    kv.free("b")  # twice is harmless
    kv.check_invariants()


def test_never_the_whole_prompt_is_a_hit() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    admit(kv, "a", prompt)
    kv.free("a")
    # Identical 8-token prompt: both blocks cached, but the last token must be computed.
    assert kv.get_computed_blocks("b", prompt).num_computed_tokens == 4
    assert kv.get_computed_blocks("c", prompt + [9]).num_computed_tokens == 8
    assert kv.get_computed_blocks("d", prompt[:3]).num_computed_tokens == 0
    assert kv.get_computed_blocks("e", []).num_computed_tokens == 0


def test_grow_caches_blocks_as_they_fill() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_kv_events=True)
    tokens = [5, 6, 7]
    assert admit(kv, "a", tokens) == [0, 1]
    assert [e.block_id for e in kv.take_events()] == [0]  # only block 0 is full
    tokens.append(8)  # a decode: token 8 sampled, then computed next step
    assert kv.allocate_slots("a", 1, num_computed_tokens=3) == []  # fits in block 1
    kv.cache_full_blocks("a", tokens, 4)
    kv.cache_full_blocks("a", tokens, 4)  # idempotent
    assert [(e.type, e.block_id) for e in kv.take_events()] == [(KVEventType.STORED, 1)]
    assert kv.allocate_slots("a", 1, num_computed_tokens=4) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    kv.check_invariants()


def test_eviction_is_lazy_and_counted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_kv_events=True)
    admit(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    assert queue_ids(kv) == [2, 3, 1, 0]
    assert kv.stats.num_evicted_blocks == 0
    assert admit(kv, "c", [9, 9, 9, 9, 9, 9]) == [2, 3, 1]  # block 1 loses its hash now
    assert kv.stats.num_evicted_blocks == 1
    events = kv.take_events()
    assert [(e.type, e.block_id) for e in events if e.type is KVEventType.REMOVED] == [(KVEventType.REMOVED, 1)]
    hit = kv.get_computed_blocks("a2", [1, 2, 3, 4, 5])
    assert [b.block_id for b in hit.blocks] == [0]  # block 0 survived at the tail


def test_misses_on_evicted_blocks_are_counted() -> None:
    """The ghost list: a lookup that misses a block the pool had cached and evicted counts its
    tokens (lost to memory pressure); a block never cached does not, nor one cached again."""
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    admit(kv, "c", [9, 9, 9, 9, 9, 9])  # evicts block 1 ([3, 4] after [1, 2])
    kv.free("c")
    assert kv.stats.num_evicted_miss_tokens == 0
    [_, three_four] = kv.get_computed_blocks("look", [1, 2, 3, 4, 5]).block_hashes
    assert kv.pool.was_evicted(three_four)
    admit(kv, "a2", [1, 2, 3, 4, 5])  # hits [1, 2], misses the evicted [3, 4], computes and caches it again
    assert kv.stats.num_hit_tokens == 2 and kv.stats.num_evicted_miss_tokens == 2
    assert not kv.pool.was_evicted(three_four)
    kv.free("a2")
    admit(kv, "d", [7, 7, 7, 7, 7])  # never cached: a miss, not a loss
    assert kv.stats.num_evicted_miss_tokens == 2


def test_only_evicted_blocks_the_lookup_could_have_hit_count() -> None:
    """Never the block holding the last token (a lookup never hits it), nor blocks after a first
    missed block that was never cached."""
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, "a", [1, 2, 3, 4, 5])  # caches [1, 2] and [3, 4]
    kv.free("a")
    admit(kv, "c", [9, 9, 9, 9, 9, 9, 9, 9])  # takes every block: both of a's are evicted
    kv.free("c")
    admit(kv, "aligned", [1, 2, 3, 4])  # [3, 4] holds its last token: no lookup could hit it
    assert kv.stats.num_evicted_miss_tokens == 2  # [1, 2] only
    kv.free("aligned")
    kv2 = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv2, "a", [1, 2, 3, 4, 5])
    kv2.free("a")
    admit(kv2, "c", [9, 9, 9, 9, 9, 9, 9, 9])
    kv2.free("c")
    admit(kv2, "other", [7, 7, 1, 2, 3])  # [7, 7] never cached: what follows is another chain
    assert kv2.stats.num_evicted_miss_tokens == 0


def test_a_lookup_not_recorded_counts_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    hit = kv.get_computed_blocks("a", [1, 2, 3])
    assert kv.allocate_slots("a", 3, num_computed_tokens=0, computed_blocks=hit, record_query=False) is not None
    assert (kv.stats.num_queried_tokens, kv.stats.num_hit_tokens, kv.stats.num_evicted_miss_tokens) == (0, 0, 0)


def test_the_ghost_list_holds_the_last_pool_size_of_evictions() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=2)
    hashes = []
    for i in range(5):  # each prompt's one full block evicts the one before it
        admit(kv, f"r{i}", [i, i, i])
        hashes.append(kv.get_computed_blocks(f"q{i}", [i, i, i]).block_hashes[0])
        kv.free(f"r{i}")
    # 0, 1, 2 and 3 were evicted; the list keeps the last two (num_blocks); 4 is still cached
    assert [kv.pool.was_evicted(h) for h in hashes] == [False, False, True, True, False]


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, "a", [1, 2, 3, 4])  # blocks 0, 1 cached
    kv.free("a")
    admit(kv, "x", [7, 7])  # takes block 2 (head of [2, 3, 1, 0])
    # b hits cached-free block 0 and needs 3 fresh ones: 4 from a queue of 3. Refused.
    b = [1, 2, 9, 9, 9, 9, 9, 9]
    hit = kv.get_computed_blocks("b", b)
    assert [blk.block_id for blk in hit.blocks] == [0]
    before = (queue_ids(kv), refcounts(kv))
    assert kv.allocate_slots("b", 6, num_computed_tokens=2, computed_blocks=hit) is None
    assert (queue_ids(kv), refcounts(kv)) == before and kv.get_block_ids("b") == []
    assert kv.stats.num_queried_tokens == 6  # refused lookups are not counted
    # Growing a running request is all-or-nothing too.
    assert kv.allocate_slots("x", 8, num_computed_tokens=2) is None
    assert kv.get_block_ids("x") == [2]
    kv.check_invariants()


def test_stale_lookup_and_misuse_raise() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=2)
    admit(kv, "a", [1, 2, 3])
    kv.free("a")
    hit = kv.get_computed_blocks("b", [1, 2, 3])
    assert hit.num_computed_tokens == 2
    admit(kv, "c", [5, 6, 7, 8])  # evicts the hit block
    kv.free("c")
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots("b", 1, num_computed_tokens=2, computed_blocks=hit)
    with pytest.raises(ValueError, match="disagrees"):
        kv.allocate_slots("b", 1, num_computed_tokens=2, computed_blocks=kv.get_computed_blocks("b", [1, 2, 3]))
    admit(kv, "d", [1])
    with pytest.raises(ValueError, match="already holds"):
        kv.get_computed_blocks("d", [1])


def test_salt_isolates_tenants() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, "a", [1, 2, 3], extra_key=b"tenant-a")
    assert kv.get_computed_blocks("b", [1, 2, 3], b"tenant-b").num_computed_tokens == 0
    assert kv.get_computed_blocks("b", [1, 2, 3]).num_computed_tokens == 0
    assert kv.get_computed_blocks("b", [1, 2, 3], b"tenant-a").num_computed_tokens == 2
    # Blocks filled later keep the request's namespace.
    kv.allocate_slots("a", 1, num_computed_tokens=3)
    kv.cache_full_blocks("a", [1, 2, 3, 4], 4)
    assert kv.get_computed_blocks("c", [1, 2, 3, 4, 5], b"tenant-a").num_computed_tokens == 4


def test_duplicate_computation_is_not_double_cached() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    for request_id in ("a", "b"):  # both admitted before either computed
        hit = kv.get_computed_blocks(request_id, [1, 2, 3])
        assert kv.allocate_slots(request_id, 3, num_computed_tokens=0, computed_blocks=hit) is not None
    kv.cache_full_blocks("a", [1, 2, 3], 3)
    kv.cache_full_blocks("b", [1, 2, 3], 3)
    assert kv.pool.blocks[0].block_hash is not None and kv.pool.blocks[2].block_hash is None
    kv.check_invariants()
    kv.free("b")
    assert queue_ids(kv) == [2, 3]  # b's duplicate block is plain free: reused first


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    admit(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5]).num_computed_tokens == 0
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.stats.num_queried_tokens == 0 and kv.stats.hit_rate == 0.0
    kv.check_invariants()


def test_usage_and_invariant_check_on_tables() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, "a", [1, 2, 3])
    assert kv.usage == 0.5 and kv.num_free_blocks == 2
    kv.pool.blocks[0].ref_count += 1  # a holder the tables do not show
    with pytest.raises(KVCacheInvariantError):
        kv.check_invariants()


def test_repeated_lookups_of_a_growing_request_hash_consistently() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert kv.get_computed_blocks("w", tokens[:3]).block_hashes == hash_block_tokens(tokens[:3], 2)
    assert kv.get_computed_blocks("w", tokens).block_hashes == hash_block_tokens(tokens, 2)
    salted = kv.get_computed_blocks("w", tokens, b"s")  # a different namespace starts over
    assert salted.block_hashes == hash_block_tokens(tokens, 2, b"s")
    kv.allocate_slots("w", 7, num_computed_tokens=0, computed_blocks=salted)
    kv.check_invariants()
    kv.free("w")
    kv.free("never-allocated")
    assert kv.get_computed_blocks("w", tokens[:4]).block_hashes == hash_block_tokens(tokens[:4], 2)
