"""BlockPool and its free queue: exact order, lazy eviction, events, invariant checks."""

from collections import Counter

import pytest

from servelm.kv.block_hash import hash_block
from servelm.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock, KVCacheInvariantError, KVEventType


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_o1_edits_keep_order() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and len(queue) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.append(blocks[2])
    queue.appendleft(queue.popleft())  # round trip at the head
    assert ids(queue) == [0, 1, 3, 4, 2]
    assert queue.check_links() == {0, 1, 2, 3, 4}
    with pytest.raises(KVCacheInvariantError):
        queue.append(blocks[0])  # already queued
    for _ in range(5):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(KVCacheInvariantError):
        queue.remove(blocks[0])


def test_allocate_free_and_lazy_eviction() -> None:
    pool = BlockPool(4, enable_prefix_caching=True, enable_kv_events=True)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1] and all(b.ref_count == 1 for b in a)
    h = hash_block(None, [1, 2])
    assert pool.cache_block(a[0], h)
    pool.free(reversed(a))
    # Block 1 has no hash: nothing to hit, so it goes to the head; cached block 0 to the tail.
    assert ids(pool.free_queue) == [1, 2, 3, 0]
    assert pool.get_cached_block(h) is a[0]  # still findable while free
    pool.check_invariants(Counter())
    taken = pool.allocate(4)
    assert [b.block_id for b in taken] == [1, 2, 3, 0]
    assert pool.get_cached_block(h) is None and a[0].block_hash is None
    assert pool.stats.num_evicted_blocks == 1
    assert [(e.type, e.block_hash, e.block_id) for e in pool.take_events()] == [
        (KVEventType.STORED, h, 0),
        (KVEventType.REMOVED, h, 0),
    ]
    assert pool.take_events() == []
    with pytest.raises(ValueError):
        pool.allocate(1)


def test_touch_revives_a_cached_free_block_from_the_middle() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, hash_block(None, [i]))
    pool.free(blocks)
    assert ids(pool.free_queue) == [0, 1, 2, 3]
    pool.touch([blocks[2]])
    assert ids(pool.free_queue) == [0, 1, 3] and blocks[2].ref_count == 1
    pool.touch([blocks[2]])
    assert blocks[2].ref_count == 2
    pool.check_invariants(Counter({2: 2}))


def test_duplicate_content_keeps_one_block_per_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block(None, [7])
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert b.block_hash is None and pool.get_cached_block(h) is a


def test_events_are_off_by_default_and_disabled_cache_stores_nothing() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, hash_block(None, [1]))
    assert pool.take_events() == []
    off = BlockPool(2, enable_prefix_caching=False)
    (b,) = off.allocate(1)
    assert not off.cache_block(b, hash_block(None, [1])) and b.block_hash is None


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(KVCacheInvariantError):
        pool.free([a])


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.check_invariants(Counter({0: 1, 1: 1}))
    with pytest.raises(KVCacheInvariantError, match="holders"):
        pool.check_invariants(Counter({0: 1}))  # block 1 held by nobody but refcount 1
    a.block_hash = hash_block(None, [3])  # a hash the map does not know
    with pytest.raises(KVCacheInvariantError, match="hash"):
        pool.check_invariants(Counter({0: 1, 1: 1}))
    a.block_hash = None
    b.ref_count = 0  # refcount 0 but not in the free queue
    with pytest.raises(KVCacheInvariantError, match="free queue"):
        pool.check_invariants(Counter({0: 1}))
