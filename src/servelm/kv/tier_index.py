"""What one KV tier (host memory, disk) holds: block hashes under a capacity, evicted LRU within
retention levels, pinned while a load reads them.

    level 2 (reused, or stored "high")    [lru ... mru]      evicted only when levels 0 and 1 are empty
    level 1 (stored "normal", not reused)  [lru ... mru]
    level 0 (stored "low")                 [lru ... mru]      evicted first

A "normal" block moves up to level 2 on its first hit: a system prompt or a conversation's
history, which many requests come back to, outlives one-off documents that were stored once and
never read (SGLang HiCache's hit-count promotion); a request or its SLO class may say so up front
("high") or mark its blocks disposable ("low": they stay at level 0 even when hit), as
TensorRT-LLM's retention priorities do. A block stored again with a higher retention moves up. A pinned block (an in-flight load reads it) is never evicted;
when every block is pinned the tier refuses new ones rather than overflow.

Torch-free bookkeeping only: the worker holds the bytes and obeys the drops this index decides.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from servelm.kv.block_hash import BlockHash

# Retention (datatypes.KV_RETENTIONS) → the level a block is stored at.
RETENTION_LEVELS = {"low": 0, "normal": 1, "high": 2}
REUSED_LEVEL = 2  # where a "normal" block goes on its first hit
NUM_LEVELS = 3


class TierIndexError(RuntimeError):
    """The index is inconsistent: a bug, never a user error."""


class TierIndex:
    """Block hashes of one tier. Not thread-safe: the scheduler is the only caller."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a tier must hold at least one block, got capacity {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._levels: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(NUM_LEVELS)]
        self._level_of: dict[BlockHash, int] = {}
        self._pins: Counter[BlockHash] = Counter()

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._level_of

    def add(self, block_hash: BlockHash, retention: str = "normal") -> tuple[bool, list[BlockHash]]:
        """Store a block at its retention's level (present: a touch, and a move up if the retention
        is higher). Returns (stored, the hashes evicted to make room): not stored when the tier is
        full of pinned blocks."""
        level = RETENTION_LEVELS[retention]
        if block_hash in self._level_of:
            if level > self._level_of[block_hash]:
                self._move(block_hash, level)
            self.touch(block_hash)
            return True, []
        evicted: list[BlockHash] = []
        while len(self._level_of) >= self.capacity_blocks:
            victim = self._victim()
            if victim is None:
                return False, evicted
            self._remove(victim)
            evicted.append(victim)
        self._levels[level][block_hash] = None
        self._level_of[block_hash] = level
        return True, evicted

    def touch(self, block_hash: BlockHash) -> None:
        """Most recently used within its level."""
        self._levels[self._level_of[block_hash]].move_to_end(block_hash)

    def hit(self, block_hash: BlockHash) -> None:
        """It was looked up and used: most recently used, and a "normal" block moves up to the
        reused level ("low" stays low)."""
        if self._level_of[block_hash] == RETENTION_LEVELS["normal"]:
            self._move(block_hash, REUSED_LEVEL)
        self.touch(block_hash)

    def _move(self, block_hash: BlockHash, level: int) -> None:
        del self._levels[self._level_of[block_hash]][block_hash]
        self._levels[level][block_hash] = None
        self._level_of[block_hash] = level

    def discard(self, block_hash: BlockHash) -> bool:
        """Forget a block found missing or corrupt (not pinned by anyone else). Returns whether it was here."""
        if block_hash not in self._level_of:
            return False
        self._remove(block_hash)
        return True

    def pin(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            if block_hash not in self._level_of:
                raise TierIndexError(f"pin of block {block_hash.hex()[:16]}, which the tier does not hold")
            self._pins[block_hash] += 1

    def unpin(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            if self._pins[block_hash] <= 0:
                raise TierIndexError(f"unpin of block {block_hash.hex()[:16]}, which is not pinned")
            self._pins[block_hash] -= 1
            if not self._pins[block_hash]:
                del self._pins[block_hash]

    def is_pinned(self, block_hash: BlockHash) -> bool:
        return self._pins[block_hash] > 0

    def _victim(self) -> BlockHash | None:
        for level in self._levels:  # lowest retention first, least recently used first
            for block_hash in level:
                if not self._pins[block_hash]:
                    return block_hash
        return None

    def _remove(self, block_hash: BlockHash) -> None:
        if self._pins[block_hash]:
            raise TierIndexError(f"block {block_hash.hex()[:16]} removed while a load reads it")
        del self._levels[self._level_of.pop(block_hash)][block_hash]
        self._pins.pop(block_hash, None)

    def check_invariants(self) -> None:
        """Raise TierIndexError unless the levels, the level map and the pins agree and fit."""
        in_levels = [h for level in self._levels for h in level]
        if len(in_levels) != len(set(in_levels)) or set(in_levels) != set(self._level_of):
            raise TierIndexError("a block is in two levels, or the level map disagrees with the levels")
        for index, level in enumerate(self._levels):
            if any(self._level_of[h] != index for h in level):
                raise TierIndexError(f"the level map disagrees with level {index}")
        if len(self._level_of) > self.capacity_blocks:
            raise TierIndexError(f"{len(self._level_of)} blocks in a tier of {self.capacity_blocks}")
        stray = [h for h, count in self._pins.items() if count <= 0 or h not in self._level_of]
        if stray:
            raise TierIndexError(f"{len(stray)} pins on blocks the tier does not hold")
