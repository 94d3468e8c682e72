"""The prefix and kv indexes: matching (the kv index per medium), bounds, and the kv index's loss detection."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.kv.block_hash import hash_block_tokens
from servelm.router.kv_index import KVIndex, KVMatch
from servelm.router.prefix_index import PrefixIndex
from servelm.schemas.kv_events import (
    CLEARED,
    DEVICE,
    DISK,
    HOST,
    REMOVED,
    STORED,
    KVEventBatch,
    KVEventRecord,
    KVSnapshot,
)

H = hash_block_tokens(list(range(16 * 40)), 16)  # 40 chained block hashes


def batch(seq: int, *records: tuple[str, bytes], epoch: str = "e1") -> KVEventBatch:
    return KVEventBatch(epoch=epoch, seq=seq, timestamp=0.0, block_size=16,
                        events=[KVEventRecord(k, h) for k, h in records])  # fmt: skip


def test_prefix_index_matches_leading_run_and_is_bounded() -> None:
    index = PrefixIndex(max_blocks_per_replica=10)
    index.insert("a", H[:8])
    assert index.match("a", H[:12]) == 8 and index.match("b", H[:12]) == 0
    index.insert("a", H[8:30])
    assert index.size("a") == 10
    assert index.match("a", H) == 0  # the oldest (leading) blocks were evicted first
    index.drop_replica("a")
    assert index.size("a") == 0


def test_prefix_index_ttl() -> None:
    now = [0.0]
    index = PrefixIndex(max_blocks_per_replica=100, ttl_s=10.0, clock=lambda: now[0])
    index.insert("a", H[:4])
    now[0] = 5.0
    assert index.match("a", H[:4]) == 4
    now[0] = 16.0
    assert index.match("a", H[:4]) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 39), st.integers(1, 10)), max_size=80))
def test_prefix_index_never_exceeds_its_bound(inserts: list[tuple[int, int, int]]) -> None:
    index = PrefixIndex(max_blocks_per_replica=7)
    for replica, start, length in inserts:
        index.insert(f"r{replica}", H[start : start + length])
        assert all(index.size(f"r{r}") <= 7 for r in range(4))


def test_kv_index_applies_events_in_order() -> None:
    index = KVIndex()
    index.apply_snapshot("a", KVSnapshot(epoch="e1", seq=0, block_size=16, block_hashes=[]))
    assert not index.apply_batch("a", batch(1, (STORED, H[0]), (STORED, H[1]), (STORED, H[2])))
    assert index.match("a", H[:5]) == 3
    assert not index.apply_batch("a", batch(2, (REMOVED, H[1])))
    assert index.match("a", H[:5]) == 1
    assert not index.apply_batch("a", batch(2, (STORED, H[1])))  # duplicate seq: ignored
    assert index.match("a", H[:5]) == 1
    assert not index.apply_batch("a", batch(3, (CLEARED, b"")))
    assert index.replica_size("a") == 0 and index.num_hashes() == 0


def test_kv_index_gap_epoch_and_heartbeat_mean_resync() -> None:
    index = KVIndex()
    index.apply_snapshot("a", KVSnapshot(epoch="e1", seq=4, block_size=16, block_hashes=list(H[:3])))
    assert not index.apply_batch("a", batch(4, epoch="e1"))  # heartbeat at the snapshot's seq: fine
    assert index.apply_batch("a", batch(6, (STORED, H[3])))  # seq 5 lost
    assert index.match("a", H) == 0 and not index.is_synced("a")  # dropped, never silently wrong
    index.apply_snapshot("a", KVSnapshot(epoch="e1", seq=6, block_size=16, block_hashes=list(H[:4])))
    assert index.match("a", H) == 4
    assert index.apply_batch("a", batch(7, epoch="e1"))  # heartbeat ahead: batch 7 never came
    index.apply_snapshot("a", KVSnapshot(epoch="e1", seq=7, block_size=16, block_hashes=list(H[:4])))
    assert index.apply_batch("a", batch(1, (STORED, H[9]), epoch="e2"))  # replica restarted
    assert index.state("a").num_resyncs == 3


def test_kv_index_drop_replica_keeps_others() -> None:
    index = KVIndex()
    for url in ("a", "b"):
        index.apply_snapshot(url, KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=list(H[:5])))
    index.drop_replica("a")
    assert index.match("a", H) == 0 and index.match("b", H) == 5 and index.num_hashes() == 5


def test_kv_index_bound_treats_overflow_as_loss() -> None:
    index = KVIndex(max_blocks_per_replica=4)
    index.apply_snapshot("a", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=list(H[:10])))
    assert index.replica_size("a") == 4
    assert index.apply_batch("a", batch(1, *[(STORED, h) for h in H[10:20]], epoch="e"))
    assert index.replica_size("a") == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 39)), max_size=200))
def test_kv_index_mirrors_any_event_stream_exactly(events: list[tuple[bool, int]]) -> None:
    index, truth = KVIndex(), set()
    index.apply_snapshot("a", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=[]))
    for seq, (stored, i) in enumerate(events, start=1):
        (truth.add if stored else truth.discard)(H[i])
        assert not index.apply_batch("a", batch(seq, (STORED if stored else REMOVED, H[i]), epoch="e"))
    assert index.state("a").block_hashes == truth and index.num_hashes() == len(truth)


def test_a_salted_request_hashes_into_the_replicas_salted_namespace() -> None:
    import asyncio

    from servelm.kv.block_hash import extra_key_from_salt, hash_block_tokens
    from servelm.router.request_view import build_view
    from servelm.tokenization.loading import load_tokenizer
    from servelm.tokenization.prompt_tokenizer import PromptTokenizer

    body = {"prompt": list(range(40)), "max_tokens": 4}
    tokenizer = PromptTokenizer(load_tokenizer(None))

    def view(extra: dict):
        return asyncio.run(build_view(tokenizer, 16, "/v1/completions", {**body, **extra}, {}))

    plain, salted = view({}), view({"cache_salt": "tenant-a"})
    assert plain.block_hashes == hash_block_tokens(list(range(40)), 16)
    # Exactly what the engine's scheduler hashes for a request with that salt (Request.extra_key).
    assert salted.block_hashes == hash_block_tokens(list(range(40)), 16, extra_key_from_salt("tenant-a"))
    assert len(salted.block_hashes) == 2 and set(salted.block_hashes).isdisjoint(plain.block_hashes)
    tokenizer.shutdown()


def tiered_snapshot(seq: int, device: list[bytes], host: list[bytes], disk: list[bytes]) -> KVSnapshot:
    return KVSnapshot(epoch="e", seq=seq, block_size=16, block_hashes=device,
                      tier_block_hashes={HOST: host, DISK: disk})  # fmt: skip


def test_kv_index_serves_the_pool_run_then_the_nearest_tier_per_block() -> None:
    index = KVIndex()
    # Blocks 0-2 in the pool; 1-5 on host (write-through copies); 4-7 on disk; block 8 nowhere.
    index.apply_snapshot("a", tiered_snapshot(0, list(H[:3]), list(H[1:6]), list(H[4:8])))
    assert index.lookup("a", H[:12]) == KVMatch(device=3, host=3, disk=2)
    assert index.lookup("a", H[:12]).num_blocks == 8 and index.match("a", H[:12]) == 3
    # A pool block after the pool run is no use by itself: the engine loads from its tiers there.
    index.apply_snapshot("b", tiered_snapshot(0, [H[0], H[2]], [H[1]], []))
    assert index.lookup("b", H[:4]) == KVMatch(device=1, host=1)
    assert index.lookup("c", H[:4]) == KVMatch()  # unknown replica
    assert index.replica_size("a") == 3 and index.replica_size("a", HOST) == 5 and index.replica_size("a", DISK) == 4


def test_kv_index_media_are_independent_sets() -> None:
    index = KVIndex()
    index.apply_snapshot("a", tiered_snapshot(0, [], [], []))
    stored = [KVEventRecord(STORED, h, medium) for h in H[:4] for medium in (DEVICE, HOST)]
    assert not index.apply_batch("a", KVEventBatch(epoch="e", seq=1, timestamp=0.0, block_size=16, events=stored))
    assert index.lookup("a", H[:4]) == KVMatch(device=4)
    # The pool evicts blocks 2-3: they stay on host; the host evicts block 0: the pool keeps it.
    removed = [KVEventRecord(REMOVED, H[2], DEVICE), KVEventRecord(REMOVED, H[3], DEVICE),
               KVEventRecord(REMOVED, H[0], HOST)]  # fmt: skip
    assert not index.apply_batch("a", KVEventBatch(epoch="e", seq=2, timestamp=0.0, block_size=16, events=removed))
    assert index.lookup("a", H[:4]) == KVMatch(device=2, host=2)
    assert index.state("a").block_hashes == {H[0], H[1]} and index.state("a").media[HOST] == {H[1], H[2], H[3]}
    assert index.num_hashes() == 4
    assert not index.apply_batch("a", batch(3, (CLEARED, b""), epoch="e"))  # a restart empties every medium
    assert index.state("a").num_blocks() == 0 and index.lookup("a", H[:4]) == KVMatch()


def test_a_record_without_a_medium_is_the_pools() -> None:
    import msgspec

    old = msgspec.msgpack.encode([STORED, H[0]])  # what a publisher before tiers sent
    assert msgspec.msgpack.decode(old, type=KVEventRecord) == KVEventRecord(STORED, H[0], DEVICE)
    old_snapshot = msgspec.msgpack.encode({"epoch": "e", "seq": 3, "block_size": 16, "block_hashes": [H[0]]})
    assert msgspec.msgpack.decode(old_snapshot, type=KVSnapshot).tier_block_hashes == {}


def test_kv_index_resync_replaces_every_medium_and_bounds_each() -> None:
    index = KVIndex(max_blocks_per_replica=4)
    index.apply_snapshot("a", tiered_snapshot(0, list(H[:2]), list(H[:8]), list(H[20:23])))
    assert index.replica_size("a", HOST) == 4 and index.lookup("a", H[:8]) == KVMatch(device=2, host=2)
    assert index.apply_batch("a", batch(2, (STORED, H[30]), epoch="e"))  # seq 1 lost: every medium dropped
    assert index.state("a").num_blocks() == 0 and not index.is_synced("a")
    index.apply_snapshot("a", tiered_snapshot(2, [], list(H[:3]), []))
    assert index.lookup("a", H[:8]) == KVMatch(host=3) and index.replica_size("a", DISK) == 0
    overflow = [KVEventRecord(STORED, h, DISK) for h in H[10:15]]
    assert index.apply_batch("a", KVEventBatch(epoch="e", seq=3, timestamp=0.0, block_size=16, events=overflow))
