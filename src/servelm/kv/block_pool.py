"""The KV block pool: blocks, refcounts, the LRU free queue and the prefix-cache map.

Knows nothing of requests or models; KV tensors live with the runner, addressed by
block id. The KVCacheManager is the only caller.

Free queue (doubly linked, O(1) append / pop / remove from the middle):

    head ─▶ [evicted first] ⇄ ... ⇄ [evicted last] ◀─ tail
            popleft() allocates       append() frees a cached block

- A freed block keeps its hash and stays findable in the cache map (lazy eviction):
  a prefix hit takes it back out of the queue from wherever it sits. Its hash is
  dropped only when `allocate` reuses it, which counts one eviction, under the tenant
  whose request cached the block (PrefixCacheStats.evicted_blocks_by_tenant).
- A freed block WITHOUT a hash (a partial last block, a duplicate, or prefix caching
  off) holds nothing anyone can hit, so it goes to the head and is reused before
  any cached block.
- Evicted hashes are remembered, the last pool-size of them (a ghost list, as in ARC), at
  most MAX_GHOSTS: a later lookup that misses on one of them lost that block to memory
  pressure, and would have hit in a pool twice the size (PrefixCacheStats.
  num_evicted_miss_tokens). Evictions alone cannot say that: most are blocks nobody asks
  for again (a finished document's).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from servelm.datatypes import DEFAULT_SLO, KVMedium
from servelm.kv.block_hash import BlockHash


class KVCacheInvariantError(RuntimeError):
    """The block bookkeeping is inconsistent: a bug, never a user error."""


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0  # number of request block tables holding this block
    block_hash: BlockHash | None = None  # set once full and computed; kept while free (lazy eviction)
    cached_by: str | None = None  # tenant of the request that cached it; set and cleared with block_hash
    # Free-queue links: both None exactly when the block is not in the free queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Blocks with refcount 0, in eviction order. Two sentinels keep every edit branch-free."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail. Bounded so a corrupted (cyclic) list cannot hang a check."""
        node = self._head.next_free
        for _ in range(self._len + 1):
            if node is None or node is self._tail:
                return
            yield node
            node = node.next_free
        raise KVCacheInvariantError("free queue is longer than its length (cycle?)")

    def check_links(self) -> set[int]:
        """The ids in the queue; raises if a block appears twice or a back link is wrong."""
        in_queue: set[int] = set()
        prev = self._head
        for block in self:
            if block.block_id in in_queue:
                raise KVCacheInvariantError(f"block {block.block_id} is in the free queue twice")
            if block.prev_free is not prev:
                raise KVCacheInvariantError(f"block {block.block_id}: broken free-queue back link")
            in_queue.add(block.block_id)
            prev = block
        if self._tail.prev_free is not prev or len(in_queue) != self._len:
            raise KVCacheInvariantError(f"free queue holds {len(in_queue)} blocks, counts {self._len}")
        return in_queue

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("pop from an empty free queue")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise KVCacheInvariantError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, block: KVBlock, prev: KVBlock | None, nxt: KVBlock | None) -> None:
        # prev/nxt are a sentinel's inner link, never None while the queue is intact.
        if prev is None or nxt is None:
            raise KVCacheInvariantError("free queue: a sentinel lost its link")
        if block.prev_free is not None or block.next_free is not None:
            raise KVCacheInvariantError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1


class KVEventType(str, enum.Enum):
    STORED = "stored"  # a block became findable under its hash
    REMOVED = "removed"  # the hash is no longer findable here (block evicted for reuse)


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """What this replica can serve without computing, per medium; a router mirrors it."""

    type: KVEventType
    block_hash: BlockHash
    block_id: int | None  # the pool block (DEVICE); None in a tier beyond the pool
    medium: KVMedium = KVMedium.DEVICE  # where the block became findable / stopped being findable


DEFAULT_TENANT = DEFAULT_SLO.tenant  # the tenant of requests without a tenants config
# Tenants counted by name in evicted_blocks_by_tenant; evictions of any further tenant count
# under OTHER_TENANTS, so a stream of made-up tenant names cannot grow the counters without bound.
MAX_COUNTED_TENANTS = 256
OTHER_TENANTS = "other"


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counters (Prometheus-counter style; never reset)."""

    num_queried_tokens: int = 0  # tokens of admitted requests looked up in the prefix cache
    num_hit_tokens: int = 0  # of those, tokens served from cached blocks
    num_evicted_miss_tokens: int = 0  # of the rest, tokens lost to evictions (KVCacheManager._evicted_miss_tokens)
    num_evicted_blocks: int = 0  # cached blocks whose hash was dropped to reuse the block
    # ... by the tenant whose request cached each. A tenant gets its key (at 0) when it first
    # caches a block, the default tenant from the start: a counter that exists reads 0, not
    # "absent". At most MAX_COUNTED_TENANTS + 1 keys.
    evicted_blocks_by_tenant: dict[str, int] = field(default_factory=lambda: {DEFAULT_TENANT: 0})

    def tenant_key(self, tenant: str) -> str:
        """The key `tenant`'s evictions count under: its own (added at 0), or OTHER_TENANTS once
        MAX_COUNTED_TENANTS are counted."""
        counts = self.evicted_blocks_by_tenant
        if tenant not in counts:
            if len(counts) >= MAX_COUNTED_TENANTS:
                return OTHER_TENANTS
            counts[tenant] = 0
        return tenant

    def count_eviction(self, tenant_key: str) -> None:
        self.num_evicted_blocks += 1
        self.evicted_blocks_by_tenant[tenant_key] = self.evicted_blocks_by_tenant.get(tenant_key, 0) + 1

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


# A GPU pool may hold millions of blocks: past this many hashes (~10 MB of them) the ghost list
# keeps only the latest evictions, and a miss on a block evicted longer ago goes uncounted.
MAX_GHOSTS = 1 << 16


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, enable_kv_events: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.stats = PrefixCacheStats()
        # One block per hash. A second block computed with the same content stays
        # unhashed (see cache_block), so this map and the blocks' hashes are a bijection.
        self._cached: dict[BlockHash, KVBlock] = {}
        # Undrained events; only recorded when someone will drain them (else they pile up).
        self._events: list[KVCacheEvent] = []
        # The hashes of the last max_ghosts evictions, oldest first (module doc: the ghost list).
        self._ghosts: OrderedDict[BlockHash, None] = OrderedDict()
        self.max_ghosts = min(num_blocks, MAX_GHOSTS)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached-free ones included (they can be evicted)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def was_evicted(self, block_hash: BlockHash) -> bool:
        """`block_hash` was cached here and evicted (among the last max_ghosts evictions), and has
        not been cached again since."""
        return block_hash in self._ghosts

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` from the head of the free queue, each with refcount 1."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self.free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """One more holder for each block (a prefix hit); cached-free blocks leave the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """One holder fewer for each block, given in the order they should be evicted."""
        for block in blocks:
            if block.ref_count <= 0:
                raise KVCacheInvariantError(f"block {block.block_id} freed with refcount {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, tenant: str = DEFAULT_TENANT) -> bool:
        """Make a full, computed, held block findable under `block_hash`; its eviction will
        count under `tenant` (the tenant of the request that computed it).

        Returns False (and leaves the block unhashed) when another block already holds
        that content: two requests computed the same block at once. Keeping one block
        per hash keeps eviction and events simple; the duplicate is reused first.
        """
        if not self.enable_prefix_caching:
            return False
        if block.block_hash is not None or block.ref_count <= 0:
            raise KVCacheInvariantError(f"block {block.block_id} cannot be cached: {block}")
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.cached_by = self.stats.tenant_key(tenant)
        self._cached[block_hash] = block
        self._ghosts.pop(block_hash, None)
        self._emit(KVEventType.STORED, block)
        return True

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int, num_evicted_miss_tokens: int = 0) -> None:
        self.stats.num_queried_tokens += num_queried_tokens
        self.stats.num_hit_tokens += num_hit_tokens
        self.stats.num_evicted_miss_tokens += num_evicted_miss_tokens

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, oldest first. Calling it twice returns [] the second time."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None and block.cached_by is not None
        del self._cached[block.block_hash]
        self._emit(KVEventType.REMOVED, block)
        self.stats.count_eviction(block.cached_by)
        self._ghosts[block.block_hash] = None
        if len(self._ghosts) > self.max_ghosts:
            self._ghosts.popitem(last=False)
        block.block_hash = block.cached_by = None

    def _emit(self, event_type: KVEventType, block: KVBlock) -> None:
        if self.enable_kv_events:
            assert block.block_hash is not None
            self._events.append(KVCacheEvent(event_type, block.block_hash, block.block_id))

    def check_invariants(self, holders: Counter[int]) -> None:
        """Raise KVCacheInvariantError unless the pool agrees with `holders`.

        `holders[block_id]` is how many block tables hold the block. Every block must be
        exactly one of: free (in the queue once, refcount 0) or held (refcount == holders),
        and the cache map must be the exact inverse of the blocks' hashes.
        """
        in_queue = self.free_queue.check_links()
        for block in self.blocks:
            self._check_block(block, block.block_id in in_queue, holders.get(block.block_id, 0))
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise KVCacheInvariantError(f"cache map key {block_hash.hex()[:16]} points at {block}")
        if not self.enable_prefix_caching and self._cached:
            raise KVCacheInvariantError("prefix caching is off but blocks are cached")

    def _check_block(self, block: KVBlock, in_queue: bool, num_holders: int) -> None:
        if block.ref_count != num_holders:
            raise KVCacheInvariantError(f"block {block.block_id}: refcount {block.ref_count}, {num_holders} holders")
        if in_queue != (block.ref_count == 0):
            state = "in" if in_queue else "not in"
            raise KVCacheInvariantError(f"block {block.block_id}: refcount {block.ref_count} but {state} free queue")
        if not in_queue and (block.prev_free is not None or block.next_free is not None):
            raise KVCacheInvariantError(f"block {block.block_id} is held but still linked in the free queue")
        if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
            raise KVCacheInvariantError(f"block {block.block_id} has a hash the cache map does not point back to")
        if (block.block_hash is None) != (block.cached_by is None):
            raise KVCacheInvariantError(f"block {block.block_id}: hash and caching tenant out of step: {block}")
