"""KVTiers' disaggregation halves, torch-free: a producer's export holds its blocks in the host
tier until pulled or expired; a consumer's pull is a load with no index behind it."""

from __future__ import annotations

import pytest

from servelm.config import KVTierConfig
from servelm.datatypes import KVExport, KVExportEnd, KVLoadResult, KVMedium, KVPeer
from servelm.kv.tiers import KVTiers

BLOCK_SIZE, BLOCK_BYTES = 4, 64


def h(n: int) -> bytes:
    return bytes([n]) * 32


def host_tiers(capacity_blocks: int) -> KVTiers:
    return KVTiers(KVTierConfig(host_bytes=capacity_blocks * BLOCK_BYTES), BLOCK_SIZE, BLOCK_BYTES)


def test_an_export_holds_its_blocks_as_they_are_saved_until_pulled():
    tiers = host_tiers(4)
    tiers.stored([(0, h(1))])  # saved before the export: pinned at once
    tiers.export("t", [h(1), h(2), h(3)])
    transfers = tiers.take_transfers()
    assert transfers.exports == [KVExport("t", [h(1), h(2), h(3)])]
    tiers.stored([(1, h(2)), (2, h(3))])  # computed later: pinned as saved
    tiers.check_invariants()
    # Other requests' blocks fill the tier: only the unheld one is ever evicted.
    for n in range(10, 20):
        tiers.stored([(n, h(n))])
        tiers.check_invariants()
    assert all(h(n) in tiers.indexes[KVMedium.HOST] for n in (1, 2, 3))
    tiers.end_export("t", KVExportEnd.COMPLETE, expires=100.0)
    assert tiers.take_transfers().export_ends == [("t", KVExportEnd.COMPLETE)]
    tiers.exports_served(["t"])
    assert tiers.num_exports == 0
    tiers.check_invariants()
    for n in range(20, 24):  # no longer held: evictable like any block
        tiers.stored([(n, h(n))])
    assert not any(h(n) in tiers.indexes[KVMedium.HOST] for n in (1, 2, 3))


def test_an_unpulled_export_expires_after_its_hold_and_the_worker_is_told():
    tiers = host_tiers(8)
    tiers.export("t", [h(1), h(2)])
    tiers.stored([(0, h(1)), (1, h(2))])
    assert tiers.expire_exports(now=50.0) == []  # its prefill has not ended: no timer yet
    tiers.end_export("t", KVExportEnd.ABORTED, expires=10.0)
    assert tiers.expire_exports(now=9.9) == []
    assert tiers.expire_exports(now=10.0) == ["t"]
    ends = tiers.take_transfers().export_ends
    assert ends == [("t", KVExportEnd.ABORTED), ("t", KVExportEnd.EXPIRED)]
    tiers.check_invariants()
    assert not tiers.indexes[KVMedium.HOST].is_pinned(h(1))


def test_two_exports_of_one_block_hold_it_until_both_let_go():
    tiers = host_tiers(2)
    tiers.export("a", [h(1)])
    tiers.export("b", [h(1)])
    tiers.stored([(0, h(1))])
    tiers.exports_served(["a"])
    tiers.stored([(1, h(2)), (2, h(3))])  # a full tier of one held block: h(2) goes, h(1) stays
    assert h(1) in tiers.indexes[KVMedium.HOST]
    tiers.exports_served(["b"])
    tiers.check_invariants()


def test_exports_need_a_host_tier():
    disk_only = KVTiers(KVTierConfig(), BLOCK_SIZE, BLOCK_BYTES, remote=True)
    with pytest.raises(ValueError, match="host tier"):
        disk_only.export("t", [h(1)])


def test_a_pull_is_a_load_without_an_index_and_counts_against_the_pull_cap():
    tiers = KVTiers(KVTierConfig(), BLOCK_SIZE, BLOCK_BYTES, remote=True)
    peer = KVPeer("tcp://127.0.0.1:1", "t")
    tiers.start_pull("r", [5, 6, 7], [h(1), h(2), h(3)], peer, deadline=30.0)
    assert tiers.num_pull_blocks == 3
    load = tiers.take_transfers().loads[0]
    assert load.peer == peer and load.media == [KVMedium.REMOTE] * 3
    assert tiers.cancel_expired(now=29.0) == [] and tiers.cancel_expired(now=30.0) == ["r"]
    tiers.finish_load(KVLoadResult("r", 2, 2 * BLOCK_BYTES, 0.01, (KVMedium.REMOTE,) * 2, failure="cancelled"))
    assert tiers.num_pull_blocks == 0
    assert tiers.counters.hit_tokens == {KVMedium.REMOTE: 2 * BLOCK_SIZE}
    tiers.check_invariants()
    with pytest.raises(ValueError, match="pull"):
        tiers.start_load("s", [1], [h(9)], [KVMedium.REMOTE], now=0.0)
    no_remote = host_tiers(4)
    with pytest.raises(ValueError, match="does not pull"):
        no_remote.start_pull("r", [1], [h(1)], peer, deadline=1.0)
