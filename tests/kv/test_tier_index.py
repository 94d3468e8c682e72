"""TierIndex: LRU within retention levels (low, normal, reused/high), pins, and refusal when full
of pinned blocks; the random interleavings are in tests/worker/test_kv_tier_properties.py."""

from __future__ import annotations

import pytest

from servelm.kv.tier_index import TierIndex, TierIndexError


def h(n: int) -> bytes:
    return bytes([n]) * 32


def fill(index: TierIndex, *entries: tuple[int, str]) -> None:
    for number, retention in entries:
        stored, evicted = index.add(h(number), retention)
        assert stored and not evicted


def test_least_recently_used_goes_first_within_a_level():
    index = TierIndex(3)
    fill(index, (1, "normal"), (2, "normal"), (3, "normal"))
    index.touch(h(1))
    assert index.add(h(4)) == (True, [h(2)])
    index.check_invariants()


def test_low_goes_before_normal_and_reused_or_high_go_last():
    index = TierIndex(4)
    fill(index, (1, "high"), (2, "normal"), (3, "normal"), (4, "low"))
    index.hit(h(2))  # reused: moves up with the high ones
    assert index.add(h(5))[1] == [h(4)]  # the low one first, although it is the newest
    assert index.add(h(6))[1] == [h(3)]  # then the normal one never reused
    assert index.add(h(7))[1] == [h(5)]  # ... the newest normal ones before reused/high
    assert h(1) in index and h(2) in index


def test_a_low_block_stays_low_when_hit_and_a_higher_retention_moves_it_up():
    index = TierIndex(2)
    fill(index, (1, "low"), (2, "normal"))
    index.hit(h(1))
    assert index.add(h(3))[1] == [h(1)]  # hit, still the first to go
    index.add(h(2), "high")  # stored again by a request that keeps it longer
    assert index.add(h(4))[1] == [h(3)]
    assert h(2) in index


def test_pinned_blocks_are_never_evicted_and_a_full_pinned_tier_refuses():
    index = TierIndex(2)
    fill(index, (1, "low"), (2, "low"))
    index.pin([h(1)])
    assert index.add(h(3)) == (True, [h(2)])
    index.pin([h(3)])
    assert index.add(h(4)) == (False, [])
    with pytest.raises(TierIndexError, match="removed while a load reads it"):
        index.discard(h(1))
    index.unpin([h(1), h(3)])
    assert index.discard(h(1)) and not index.discard(h(1))
    with pytest.raises(TierIndexError, match="not pinned"):
        index.unpin([h(3)])
    with pytest.raises(TierIndexError, match="does not hold"):
        index.pin([h(9)])
    index.check_invariants()
