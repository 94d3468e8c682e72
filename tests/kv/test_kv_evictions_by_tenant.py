"""Prefix-cache evictions counted by the tenant whose request cached the evicted block."""

from servelm.kv import KVCacheManager, PrefixCacheStats
from servelm.kv.block_pool import MAX_COUNTED_TENANTS, OTHER_TENANTS


def compute(kv: KVCacheManager, request_id: str, tokens: list[int], tenant: str) -> list[int] | None:
    """Look up, allocate the whole remainder, compute it, cache what became full under `tenant`."""
    hit = kv.get_computed_blocks(request_id, tokens)
    new_ids = kv.allocate_slots(
        request_id,
        len(tokens) - hit.num_computed_tokens,
        num_computed_tokens=hit.num_computed_tokens,
        computed_blocks=hit,
    )
    if new_ids is not None:
        kv.cache_full_blocks(request_id, tokens, len(tokens), tenant)
    kv.check_invariants()
    return new_ids


def test_evictions_count_under_the_tenant_that_cached_the_block() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    assert compute(kv, "a", [1, 2, 3, 4], "alice") == [0, 1]
    assert compute(kv, "b", [5, 6, 7], "bob") == [2, 3]  # one full block (2), one partial (3)
    kv.free("a")
    kv.free("b")
    # Freed is not evicted (still findable); every tenant that cached a block has its counter.
    assert kv.stats.evicted_blocks_by_tenant == {"default": 0, "alice": 0, "bob": 0}
    # A prefix hit on alice's first block by carol does not change who cached it.
    assert compute(kv, "c", [1, 2, 9, 9, 9, 9, 9, 9, 9, 9], "carol") == [0, 3, 4, 5, 1]
    # Fresh blocks came from the head: 3 (bob's unhashed tail), 4, 5 (never cached), then 1: alice's
    # second block lost its hash. Bob's cached block 2 is still free and findable.
    assert kv.stats.evicted_blocks_by_tenant == {"default": 0, "alice": 1, "bob": 0, "carol": 0}
    assert kv.stats.num_evicted_blocks == 1
    kv.free("c")
    assert compute(kv, "d", list(range(100, 112)), "dave") is not None  # every block: all cached ones go
    # carol cached her 4 new full blocks (3, 4, 5, 1); block 0 stays alice's, block 2 bob's.
    assert kv.stats.evicted_blocks_by_tenant == {"default": 0, "alice": 2, "bob": 1, "carol": 4, "dave": 0}
    assert kv.stats.num_evicted_blocks == sum(kv.stats.evicted_blocks_by_tenant.values())


def test_tenants_counted_by_name_are_bounded() -> None:
    stats = PrefixCacheStats()  # "default" holds one of the keys from the start
    for i in range(MAX_COUNTED_TENANTS + 10):
        stats.count_eviction(stats.tenant_key(f"tenant{i}"))
    stats.count_eviction(stats.tenant_key("tenant0"))  # one already counted keeps its own key
    assert len(stats.evicted_blocks_by_tenant) == MAX_COUNTED_TENANTS + 1
    assert stats.evicted_blocks_by_tenant[OTHER_TENANTS] == 11 and stats.evicted_blocks_by_tenant["tenant0"] == 2
    assert stats.evicted_blocks_by_tenant["default"] == 0
    assert stats.num_evicted_blocks == MAX_COUNTED_TENANTS + 11
