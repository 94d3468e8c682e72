"""KV events of the tiers beyond the pool (KVTiers with enable_kv_events): a block joining a tier's
index is STORED with that tier's medium, one leaving it (evicted, found missing or corrupt) is
REMOVED; a mirror rebuilt from the events alone always equals what each tier's index holds."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import KVTierConfig
from servelm.datatypes import KVLoadResult, KVMedium
from servelm.kv.block_pool import KVCacheEvent, KVEventType
from servelm.kv.disk_store import DiskBlockStore
from servelm.kv.tiers import KVTiers

BLOCK_SIZE = 4
BLOCK_BYTES = 64
STORED, REMOVED = KVEventType.STORED, KVEventType.REMOVED
HOST, DISK = KVMedium.HOST, KVMedium.DISK


def h(content: int) -> bytes:
    return hashlib.sha256(f"block {content}".encode()).digest()


def summary(events: list[KVCacheEvent]) -> list[tuple[KVEventType, bytes, KVMedium]]:
    assert all(e.block_id is None for e in events)  # a tier has no pool block
    return [(e.type, e.block_hash, e.medium) for e in events]


def host_tiers(num_blocks: int, enable_kv_events: bool = True) -> KVTiers:
    config = KVTierConfig(host_bytes=num_blocks * BLOCK_BYTES)
    return KVTiers(config, BLOCK_SIZE, BLOCK_BYTES, enable_kv_events=enable_kv_events)


def test_saves_and_evictions_are_events_of_the_host_medium() -> None:
    tiers = host_tiers(num_blocks=2)
    tiers.stored([(0, h(0)), (1, h(1))])
    tiers.stored([(0, h(0))])  # already held: a touch, no event
    tiers.stored([(2, h(2))])  # evicts h(1), the least recently used
    assert summary(tiers.take_events()) == [
        (STORED, h(0), HOST), (STORED, h(1), HOST), (REMOVED, h(1), HOST), (STORED, h(2), HOST),
    ]  # fmt: skip
    assert tiers.take_events() == []  # taken once


def test_no_events_recorded_when_off() -> None:
    tiers = host_tiers(num_blocks=2, enable_kv_events=False)
    tiers.stored([(0, h(0)), (1, h(1)), (2, h(2))])
    assert tiers.take_events() == [] and h(2) in tiers.indexes[HOST]


def test_disk_files_adopted_at_start_and_on_lookup_are_stored_events(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, "fp")
    store.write(h(1), b"x" * BLOCK_BYTES)  # written before a restart
    config = KVTierConfig(disk_path=str(tmp_path))
    tiers = KVTiers(config, BLOCK_SIZE, BLOCK_BYTES, store, enable_kv_events=True)
    assert summary(tiers.take_events()) == [(STORED, h(1), DISK)]
    store.write(h(2), b"y" * BLOCK_BYTES)  # another replica's, sharing the directory
    assert tiers.lookup([h(1), h(2)], 0, 2) == [DISK, DISK]
    assert summary(tiers.take_events()) == [(STORED, h(2), DISK)]


def test_a_block_found_corrupt_is_removed_from_its_medium_only() -> None:
    tiers = host_tiers(num_blocks=4)
    tiers.stored([(0, h(0)), (1, h(1))])
    tiers.take_events()
    tiers.start_load("r", [5, 6], [h(0), h(1)], [HOST, HOST], now=0.0)
    tiers.finish_load(KVLoadResult("r", 1, BLOCK_BYTES, 0.01, (HOST,), failure="corrupt: bad crc"))
    assert summary(tiers.take_events()) == [(REMOVED, h(1), HOST)]
    tiers.start_load("s", [5], [h(0)], [HOST], now=0.0)
    tiers.finish_load(KVLoadResult("s", 0, 0, 0.01, (), failure="cancelled"))  # late, not bad: kept
    assert tiers.take_events() == [] and h(0) in tiers.indexes[HOST]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("store"), st.lists(st.integers(0, 11), min_size=1, max_size=4)),
            st.tuples(st.just("load"), st.lists(st.integers(0, 11), min_size=1, max_size=3)),
        ),
        max_size=40,
    ),
    st.integers(1, 5),
    st.sampled_from([None, "missing", "corrupt: truncated", "cancelled"]),
)
def test_a_mirror_of_the_events_equals_each_tier_index(ops: list, capacity: int, failure: str | None) -> None:
    tiers = host_tiers(num_blocks=capacity)
    mirror: dict[KVMedium, set[bytes]] = {HOST: set()}
    for step, (op, contents) in enumerate(ops):
        hashes = [h(c) for c in contents]
        if op == "store":
            tiers.stored(list(enumerate(hashes)))
        else:
            media = tiers.lookup(hashes, 0, len(hashes))
            if media:
                request_id = f"r{step}"
                tiers.start_load(request_id, list(range(len(media))), hashes[: len(media)], media, now=0.0)
                loaded = len(media) - 1 if failure else len(media)
                result = KVLoadResult(request_id, loaded, loaded * BLOCK_BYTES, 0.01, tuple(media[:loaded]), failure)
                tiers.finish_load(result)
        for event in tiers.take_events():
            held = mirror.setdefault(event.medium, set())
            (held.add if event.type is STORED else held.discard)(event.block_hash)
        universe = {h(c) for c in range(12)}
        assert mirror[HOST] == {b for b in universe if b in tiers.indexes[HOST]}
        assert len(mirror[HOST]) <= capacity
