"""KVCacheManager: per-request block tables over the BlockPool, plus the prefix cache.

The scheduler is the only caller. The manager never touches a request: it takes ids
and token ids and returns allocations; the scheduler decides what they mean.

Block table of a request (append-only), block_size = 4, 10 tokens with KV:

    token positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    block table       [  b7   |   b2    |   b5   ]
    block hashes      [  h0   |   h1    ]          h1 = hash(h0, tokens 4..7)
                      ↑ full blocks only; b5 is partial and never cached

Life of a request's blocks:

    get_computed_blocks ─▶ allocate_slots (first call: prefix hit + new blocks)
                           allocate_slots (every later step: new blocks only)
                           cache_full_blocks (after each step computed tokens)
                           free (finished, aborted or preempted)

No block is reserved (no null block): every block id in [0, num_blocks) is usable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from servelm.kv.block_hash import BlockHash, extend_block_hashes
from servelm.kv.block_pool import (
    DEFAULT_TENANT,
    BlockPool,
    KVBlock,
    KVCacheEvent,
    KVCacheInvariantError,
    PrefixCacheStats,
)


@dataclass
class ComputedBlocks:
    """A prefix-cache lookup, to be handed to allocate_slots right away.

    Valid only until the next allocation: allocating may evict the cached-free blocks
    it names (allocate_slots checks and raises on a stale lookup).
    """

    blocks: list[KVBlock]  # cached blocks holding the longest hit prefix, in order
    num_computed_tokens: int  # len(blocks) * block_size
    num_queried_tokens: int  # tokens looked up (hit-rate denominator)
    block_hashes: list[BlockHash] = field(default_factory=list)  # every full block of the tokens
    extra_key: bytes | None = None  # the cache namespace (cache_salt) the request hashes under

    @classmethod
    def miss(cls, extra_key: bytes | None = None) -> ComputedBlocks:
        """No lookup (e.g. the request needs logits at every prompt position) but a namespace:
        the blocks it computes are still cached under its extra_key."""
        return cls(blocks=[], num_computed_tokens=0, num_queried_tokens=0, extra_key=extra_key)


@dataclass
class _RequestBlocks:
    blocks: list[KVBlock]  # the block table; append-only until free()
    block_hashes: list[BlockHash]  # hashes of full blocks known so far (may run ahead of the KV)
    extra_key: bytes | None
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        enable_kv_events: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, enable_kv_events)
        self._requests: dict[str, _RequestBlocks] = {}
        # Block hashes of requests looked up but not yet allocated (a waiting request may be
        # looked up every step while it does not fit): hashed once, extended as it grows.
        # Dropped on its first allocation or on free().
        self._lookup_hashes: dict[str, tuple[bytes | None, list[BlockHash]]] = {}

    # -- queries -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-free ones included: they are evictable)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        return self.pool.stats

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table ([] when it holds none)."""
        state = self._requests.get(request_id)
        return [b.block_id for b in state.blocks] if state else []

    def take_events(self) -> list[KVCacheEvent]:
        """Block stored / removed events since the last call (empty unless enable_kv_events)."""
        return self.pool.take_events()

    # -- the request life cycle -------------------------------------------------------

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], extra_key: bytes | None = None
    ) -> ComputedBlocks:
        """The longest prefix of `token_ids` whose full blocks are cached. Changes nothing.

        Never the whole sequence: at most (len - 1) tokens, so the last token is still
        computed and yields logits. When every full block hits and the sequence ends on a
        block boundary, that drops the last block from the hit.

        `token_ids` may only have grown since a previous lookup of the same request (its
        hashes are remembered until its first allocation or free()).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks; look up before its first allocation")
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0, 0, extra_key=extra_key)
        memo_key, block_hashes = self._lookup_hashes.get(request_id, (extra_key, []))
        if memo_key != extra_key:
            block_hashes = []
        extend_block_hashes(block_hashes, token_ids, self.block_size, extra_key)
        self._lookup_hashes[request_id] = (extra_key, block_hashes)
        blocks: list[KVBlock] = []
        for block_hash in block_hashes[: self._max_hit_blocks(len(token_ids))]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(
            blocks=blocks,
            num_computed_tokens=len(blocks) * self.block_size,
            num_queried_tokens=len(token_ids),
            block_hashes=list(block_hashes),
            extra_key=extra_key,
        )

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        num_computed_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        record_query: bool = True,
    ) -> list[int] | None:
        """Make room for KV of tokens [num_computed_tokens, num_computed_tokens + num_new_tokens).

        Pass `computed_blocks` on a request's first allocation only: the lookup, or
        ComputedBlocks.miss(extra_key) when it skips the lookup (without one its blocks are
        cached with no extra key). `num_computed_tokens` must then equal the lookup's. The
        lookup counts in the prefix-cache stats unless `record_query` is False: a KV-tier load's
        allocation, whose request is looked up again (and counted) once its blocks are in.

        All or nothing: returns None and changes nothing when too few blocks are free.
        Free cached blocks count as free and are evicted lazily. Returns the block ids
        appended to the request's table by this call (on the first call: the prefix-hit
        blocks, then the fresh ones).
        """
        state = self._requests.get(request_id)
        hit = self._validate_hit(request_id, state, num_computed_tokens, computed_blocks)
        num_held = len(state.blocks) if state else 0
        num_required = _cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_fresh = max(0, num_required - num_held - len(hit))
        # A hit on a cached-FREE block takes it out of the free queue too.
        num_revived = sum(1 for block in hit if block.ref_count == 0)
        if num_fresh + num_revived > self.pool.num_free_blocks:
            return None
        if state is None:
            state = _RequestBlocks(blocks=[], block_hashes=[], extra_key=None)
            self._requests[request_id] = state
        if computed_blocks is not None:
            self._lookup_hashes.pop(request_id, None)
            state.block_hashes = list(computed_blocks.block_hashes)
            state.extra_key = computed_blocks.extra_key
            state.num_cached_blocks = len(hit)
            if self.enable_prefix_caching and record_query:
                self.pool.record_prefix_query(computed_blocks.num_queried_tokens, computed_blocks.num_computed_tokens,
                                              self._evicted_miss_tokens(computed_blocks, len(hit)))  # fmt: skip
        self.pool.touch(hit)
        new_blocks = hit + self.pool.allocate(num_fresh)
        state.blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def _evicted_miss_tokens(self, lookup: ComputedBlocks, num_hit_blocks: int) -> int:
        """Tokens the lookup would have hit but for evictions, within the blocks a lookup may hit
        (never the one holding the last token): when the first block it missed had been evicted,
        that block and the run after it that is evicted too or still cached (the eviction broke
        the chain there: they are recomputed with it), up to a block never cached."""
        lost = 0
        for block_hash in lookup.block_hashes[num_hit_blocks : self._max_hit_blocks(lookup.num_queried_tokens)]:
            if not (self.pool.was_evicted(block_hash) or (lost and self.pool.get_cached_block(block_hash))):
                break
            lost += 1
        return lost * self.block_size

    def _max_hit_blocks(self, num_tokens: int) -> int:
        """Full blocks a lookup of `num_tokens` may hit: never the one holding the last token,
        which is still computed so that it yields logits."""
        return max(0, num_tokens - 1) // self.block_size

    def max_new_tokens(
        self, request_id: str, *, num_computed_tokens: int, computed_blocks: ComputedBlocks | None = None
    ) -> int:
        """Most new tokens allocate_slots would place right now with the same arguments: it
        succeeds for any num_new_tokens up to this. Changes nothing (the scheduler asks it to
        shrink a chunk to the free blocks)."""
        state = self._requests.get(request_id)
        hit = computed_blocks.blocks if computed_blocks is not None else []
        num_held = len(state.blocks) if state else 0
        # Cached-free hit blocks are among the free ones: reviving them leaves fewer for fresh KV.
        num_fresh = self.pool.num_free_blocks - sum(1 for block in hit if block.ref_count == 0)
        return (num_held + len(hit) + num_fresh) * self.block_size - num_computed_tokens

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, tenant: str = DEFAULT_TENANT
    ) -> list[tuple[int, BlockHash]]:
        """Offer the request's blocks that became full and computed to the prefix cache.

        Call after a step with the request's tokens so far (prompt + output), its new
        num_computed_tokens and its tenant (their evictions count under it). Idempotent; a
        no-op with prefix caching off. Returns the (block id, hash) of the blocks it cached (a
        block whose content another block already holds is not among them): what the KV tiers save.
        """
        if not self.enable_prefix_caching:
            return []
        state = self._requests[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(state.blocks))
        if num_full <= state.num_cached_blocks:
            return []
        extend_block_hashes(state.block_hashes, token_ids, self.block_size, state.extra_key)
        cached = []
        for i in range(state.num_cached_blocks, num_full):
            block, block_hash = state.blocks[i], state.block_hashes[i]
            if self.pool.cache_block(block, block_hash, tenant):
                cached.append((block.block_id, block_hash))
        state.num_cached_blocks = num_full
        return cached

    def free(self, request_id: str) -> None:
        """Release the request's blocks (and forget its lookups). Safe to call for a request
        that holds none; call it for a request that was looked up and then dropped.

        Freed in REVERSE table order: a sequence's tail blocks (shared by fewest other
        prompts) reach the free queue first and are evicted first.
        """
        self._lookup_hashes.pop(request_id, None)
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.pool.free(reversed(state.blocks))

    # -- checks ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise KVCacheInvariantError unless every block is exactly free or held.

        Held: refcount == number of block tables holding it. Free: in the free queue once,
        refcount 0. The hash map points only at blocks carrying that hash.
        """
        holders: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            ids = [block.block_id for block in state.blocks]
            if len(set(ids)) != len(ids):
                raise KVCacheInvariantError(f"request {request_id!r} holds a block twice: {ids}")
            for block in state.blocks:
                if self.pool.blocks[block.block_id] is not block:
                    raise KVCacheInvariantError(f"request {request_id!r} holds a foreign block {block}")
            if state.num_cached_blocks > len(state.blocks):
                raise KVCacheInvariantError(f"request {request_id!r} cached more blocks than it holds")
            holders.update(ids)
            if request_id in self._lookup_hashes:
                raise KVCacheInvariantError(f"request {request_id!r} holds blocks but still has a pending lookup")
        self.pool.check_invariants(holders)

    def _validate_hit(
        self,
        request_id: str,
        state: _RequestBlocks | None,
        num_computed_tokens: int,
        computed_blocks: ComputedBlocks | None,
    ) -> list[KVBlock]:
        if computed_blocks is None:
            return []
        if state is not None:
            raise ValueError(f"request {request_id!r} already holds blocks; computed_blocks is for the first allocation")
        if num_computed_tokens != computed_blocks.num_computed_tokens:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} disagrees with the lookup's "
                f"{computed_blocks.num_computed_tokens}"
            )
        for block, expected_hash in zip(computed_blocks.blocks, computed_blocks.block_hashes):
            # Evicted and perhaps reused for other content since the lookup: hash differs.
            if block.block_hash != expected_hash:
                raise ValueError(f"stale prefix lookup for {request_id!r}: block {block.block_id} was evicted")
        return computed_blocks.blocks
