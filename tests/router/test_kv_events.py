"""The engine's KV event publisher and the router's subscriber, over real ZMQ sockets.

A real KVCacheManager (small pool, so blocks get evicted) records events, and with tiers a real
KVTiers (a small host tier, so it evicts too) is told of every block the pool caches, as the
scheduler does; a thread plays the engine-core loop (poll → answer snapshots → publish); the
router side is the real KVSubscriber feeding a KVIndex. The index must end equal to the pool's
cached set and the host tier's, also after a lost batch (forced resync from a snapshot).
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import zmq
import zmq.asyncio

from servelm.config import KVTierConfig
from servelm.datatypes import KVMedium
from servelm.engine.kv_events import KVEventPublisher
from servelm.kv.block_hash import hash_block_tokens
from servelm.kv.kv_cache_manager import KVCacheManager
from servelm.kv.tiers import KVTiers
from servelm.ports import free_port
from servelm.router.kv_index import KVIndex
from servelm.router.kv_subscriber import KVSubscriber
from servelm.schemas.kv_events import HOST, event_addresses

BLOCK = 4


def run_request(kv: KVCacheManager, request_id: str, token_ids: list[int], tiers: KVTiers | None = None) -> None:
    """One request through the cache as the scheduler drives it: look up, allocate, compute,
    save the computed blocks to the tiers (their copies are ordered; no worker runs here), free."""
    hit = kv.get_computed_blocks(request_id, token_ids)
    kv.allocate_slots(request_id, len(token_ids) - hit.num_computed_tokens,
                      num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit)  # fmt: skip
    kv.cache_full_blocks(request_id, token_ids, len(token_ids))
    if tiers is not None:
        tiers.stored(list(zip(kv.get_block_ids(request_id), hash_block_tokens(token_ids, BLOCK), strict=False)))
        tiers.take_transfers()
    kv.free(request_id)


class CoreLoop:
    """The engine-core side: the publisher, stepped from one thread like core_process._serve."""

    def __init__(self, kv: KVCacheManager, port: int, tiers: KVTiers | None = None) -> None:
        self.kv = kv
        self.tiers = tiers
        self.lock = threading.Lock()
        self.context = zmq.Context()
        self.publisher = KVEventPublisher(self.context, "127.0.0.1", port, BLOCK, self._drain)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        self.publisher.register(poller)
        while not self._stop.is_set():
            ready = dict(poller.poll(10))
            with self.lock:
                self.publisher.handle(ready)
                self.publisher.publish()

    def _drain(self) -> list:
        """Scheduler.take_kv_events: the pool's events, then the tiers'."""
        return self.kv.take_events() + (self.tiers.take_events() if self.tiers is not None else [])

    def cached_hashes(self, candidates: set[bytes]) -> set[bytes]:
        with self.lock:
            return {h for h in candidates if self.kv.pool.get_cached_block(h) is not None}

    def host_hashes(self, candidates: set[bytes]) -> set[bytes]:
        assert self.tiers is not None
        with self.lock:
            return {h for h in candidates if h in self.tiers.indexes[KVMedium.HOST]}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.publisher.close()
        self.context.term()


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("with_tiers", [False, True], ids=["pool", "pool+host"])
@pytest.mark.parametrize("lose_a_batch", [False, True])
def test_subscriber_mirrors_the_pool_and_tiers_exactly(lose_a_batch: bool, with_tiers: bool) -> None:
    asyncio.run(_mirror(lose_a_batch, with_tiers))


async def _mirror(lose_a_batch: bool, with_tiers: bool) -> None:
    kv = KVCacheManager(num_blocks=24, block_size=BLOCK, enable_kv_events=True)
    # 30 blocks of host memory: more than the pool, fewer than the blocks the run computes.
    tiers = KVTiers(KVTierConfig(host_bytes=30 * 64), BLOCK, 64, enable_kv_events=True) if with_tiers else None
    port = free_port()
    core = CoreLoop(kv, port, tiers)
    context = zmq.asyncio.Context()
    index = KVIndex()
    pub_address, snapshot_address = event_addresses("127.0.0.1", port)
    subscriber = KVSubscriber(context, "replica", pub_address, snapshot_address, index)
    rng = random.Random(0)
    seen: set[bytes] = set()
    try:
        subscriber.start()
        await wait_for(lambda: index.is_synced("replica"))
        for i in range(40):
            prefix = [rng.randrange(5)] * 8  # few distinct prefixes: hits, and a pool too small for all
            tokens = prefix + [rng.randrange(100) for _ in range(rng.randrange(4, 12))]
            with core.lock:
                run_request(kv, f"r{i}", tokens, tiers)
                if lose_a_batch and i == 20:
                    core.publisher.seq += 1  # the next batch arrives with a hole before it
            seen.update(hash_block_tokens(tokens, BLOCK))
            await asyncio.sleep(0.005)
        await wait_for(lambda: index.state("replica").block_hashes == core.cached_hashes(seen))
        if tiers is not None:
            await wait_for(lambda: index.state("replica").media.get(HOST) == core.host_hashes(seen))
            assert len(core.host_hashes(seen)) == 30 < len(seen)  # the host tier evicted too
        assert index.replica_size("replica") <= kv.num_blocks
        expected_resyncs = 2 if lose_a_batch else 1
        await wait_for(lambda: index.state("replica").num_resyncs >= expected_resyncs)
        assert index.state("replica").num_resyncs == expected_resyncs
    finally:
        await subscriber.stop()
        context.term()
        core.close()
