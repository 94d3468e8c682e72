"""Approximate prefix index: which block hashes the router has sent to each replica.

Used by the `prefix` policy, which needs nothing from the replicas: a prompt's block
hashes (servelm.kv.block_hash, the engine's own function) are recorded under the replica
it was routed to, and a later prompt scores by how many of its leading blocks that
replica has seen. It is a guess (the replica may have evicted them); the `kv` policy uses
the replica's own events instead (kv_index.py).

Bounded two ways, so it never grows with traffic: at most `max_blocks_per_replica`
hashes per replica (least recently used go first), and entries older than `ttl_s` count
as absent (a replica's cache turns over; an old guess is worse than none).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from servelm.kv.block_hash import BlockHash


class ReplicaPrefixLRU:
    """One replica's hashes → last time sent, in LRU order (oldest first)."""

    def __init__(self, max_blocks: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._clock = clock
        self._seen: OrderedDict[BlockHash, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes are present and fresh. Read-only apart from dropping stale ones.

        Stops at the first miss: the hash chain means block i can only be reused if
        blocks 0..i-1 are too.
        """
        now = self._clock()
        matched = 0
        for block_hash in block_hashes:
            seen_at = self._seen.get(block_hash)
            if seen_at is None:
                break
            if now - seen_at > self.ttl_s:
                del self._seen[block_hash]
                break
            matched += 1
        return matched

    def insert(self, block_hashes: Sequence[BlockHash]) -> None:
        """Record (or refresh) every hash as just sent, then evict down to the bound."""
        now = self._clock()
        for block_hash in block_hashes:
            self._seen[block_hash] = now
            self._seen.move_to_end(block_hash)
        while len(self._seen) > self.max_blocks:
            self._seen.popitem(last=False)


class PrefixIndex:
    """Per-replica ReplicaPrefixLRU, keyed by replica URL."""

    def __init__(
        self, max_blocks_per_replica: int = 65536, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_blocks_per_replica <= 0 or ttl_s <= 0:
            raise ValueError("max_blocks_per_replica and ttl_s must be positive")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.ttl_s = ttl_s
        self._clock = clock
        self._replicas: dict[str, ReplicaPrefixLRU] = {}

    def match(self, url: str, block_hashes: Sequence[BlockHash]) -> int:
        lru = self._replicas.get(url)
        return lru.match(block_hashes) if lru is not None else 0

    def insert(self, url: str, block_hashes: Sequence[BlockHash]) -> None:
        lru = self._replicas.get(url)
        if lru is None:
            lru = self._replicas[url] = ReplicaPrefixLRU(self.max_blocks_per_replica, self.ttl_s, self._clock)
        lru.insert(block_hashes)

    def drop_replica(self, url: str) -> None:
        """Forget a replica (it failed or was removed: its cache is gone or unknown)."""
        self._replicas.pop(url, None)

    def size(self, url: str) -> int:
        lru = self._replicas.get(url)
        return len(lru) if lru is not None else 0
