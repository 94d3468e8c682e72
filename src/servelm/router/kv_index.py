"""Exact index of what the replicas can serve without computing, per medium, mirrored from their
KV events.

    replica URL ──▶ ReplicaKVState       (its publisher epoch, last seq applied, and per medium
                                          the block hashes held there: "device" = its pool,
                                          "host" / "disk" = its KV tiers)

Fed by kv_subscriber.py with each replica's KVEventBatch stream (servelm.schemas.kv_events).
The stream is lossy (ZMQ PUB drops), so every batch is checked against the replica's
sequence number: a hole, a new epoch, or a heartbeat ahead of what was applied means
something was lost. Then the replica's entries are dropped at once (a wrong index is
worse than an empty one) and `apply_batch` says so; the caller fetches a snapshot and
hands it to `apply_snapshot`, after which batches continue from the snapshot's seq.

Each medium is its own set: a block is often in several (the tiers are write-through), and a
record about one medium never changes another. `lookup` answers how a replica would serve a
prompt, the way its engine admits one (scheduler/tier_loads.py): the leading run of blocks in
its pool, then the run that follows in its tiers, each block from the nearest tier holding it.

Bounded: a replica holds at most `max_blocks_per_replica` hashes in each medium (set it to at
least the replicas' largest tier, in blocks). More than that can only mean a corrupted stream,
which is treated like a hole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from servelm.kv.block_hash import BlockHash
from servelm.schemas.kv_events import CLEARED, DEVICE, DISK, HOST, REMOVED, STORED, KVEventBatch, KVSnapshot

TIERS_NEAREST_FIRST = (HOST, DISK)  # where an engine looks after its pool, in this order


@dataclass(frozen=True)
class KVMatch:
    """How a replica can serve a prompt's leading blocks: `device` from its pool, then `host` and
    `disk` blocks loaded from its tiers; the prompt's later blocks are computed."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def num_blocks(self) -> int:
        return self.device + self.host + self.disk

    @property
    def num_tier_blocks(self) -> int:
        return self.host + self.disk

    def by_medium(self) -> dict[str, int]:
        return {DEVICE: self.device, HOST: self.host, DISK: self.disk}


@dataclass
class ReplicaKVState:
    epoch: str | None = None  # publisher epoch the state below belongs to; None: not synced
    last_seq: int = 0  # last batch applied (or the snapshot's seq)
    media: dict[str, set[BlockHash]] = field(default_factory=dict)  # medium → block hashes held there
    num_resyncs: int = 0

    @property
    def block_hashes(self) -> set[BlockHash]:
        """The pool's (DEVICE) hashes."""
        return self.media.get(DEVICE, set())

    def num_blocks(self) -> int:
        """Hashes held, all media together (a block in two media counts twice)."""
        return sum(len(held) for held in self.media.values())


class KVIndex:
    """Not thread-safe: the router's event loop (the subscribers, the policy) is its only user."""

    def __init__(self, max_blocks_per_replica: int = 1 << 20) -> None:
        if max_blocks_per_replica <= 0:
            raise ValueError(f"max_blocks_per_replica must be positive, got {max_blocks_per_replica}")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._replicas: dict[str, ReplicaKVState] = {}

    # -- queries ---------------------------------------------------------------------

    def lookup(self, url: str, block_hashes: Sequence[BlockHash]) -> KVMatch:
        """How the replica would serve `block_hashes` (a prompt's full blocks, in order): the
        leading run in its pool, then the run that follows in its tiers (host before disk), up
        to the first block none of those holds. KVMatch() while the replica is not synced."""
        state = self._replicas.get(url)
        if state is None:
            return KVMatch()
        device = self._leading_run(state.media.get(DEVICE, set()), block_hashes)
        tiers = [(medium, held) for medium in TIERS_NEAREST_FIRST if (held := state.media.get(medium))]
        from_tier = dict.fromkeys(TIERS_NEAREST_FIRST, 0)
        for block_hash in block_hashes[device:]:
            medium = next((m for m, held in tiers if block_hash in held), None)
            if medium is None:
                break
            from_tier[medium] += 1
        return KVMatch(device, from_tier[HOST], from_tier[DISK])

    def match(self, url: str, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` in the replica's pool (0 while it is not synced)."""
        return self.lookup(url, block_hashes).device

    def is_synced(self, url: str) -> bool:
        state = self._replicas.get(url)
        return state is not None and state.epoch is not None

    def replica_size(self, url: str, medium: str = DEVICE) -> int:
        """Hashes the replica holds in `medium` (its pool by default)."""
        state = self._replicas.get(url)
        return len(state.media.get(medium, ())) if state is not None else 0

    def num_hashes(self) -> int:
        """Distinct hashes held by any replica, in any medium."""
        return len(set().union(*(held for state in self._replicas.values() for held in state.media.values())))

    def state(self, url: str) -> ReplicaKVState | None:
        return self._replicas.get(url)

    # -- updates ---------------------------------------------------------------------

    def apply_batch(self, url: str, batch: KVEventBatch) -> bool:
        """Apply one batch from `url`'s publisher. Returns True when the replica needs a snapshot.

        Old or duplicate batches (seq <= last applied, same epoch) are ignored.
        """
        state = self._replicas.setdefault(url, ReplicaKVState())
        if state.epoch != batch.epoch:
            return self._lost(state)
        if not batch.events:  # heartbeat: says which seq we should have reached
            return self._lost(state) if batch.seq > state.last_seq else False
        if batch.seq <= state.last_seq:
            return False
        if batch.seq != state.last_seq + 1:
            return self._lost(state)
        for record in batch.events:
            if record.kind == STORED:
                state.media.setdefault(record.medium, set()).add(record.block_hash)
            elif record.kind == REMOVED:
                state.media.get(record.medium, set()).discard(record.block_hash)
            elif record.kind == CLEARED:
                state.media.clear()
        state.last_seq = batch.seq
        if any(len(held) > self.max_blocks_per_replica for held in state.media.values()):
            return self._lost(state)
        return False

    def apply_snapshot(self, url: str, snapshot: KVSnapshot) -> None:
        """Replace the replica's entries with the snapshot; batches resume after `snapshot.seq`."""
        state = self._replicas.setdefault(url, ReplicaKVState())
        state.epoch = snapshot.epoch
        state.last_seq = snapshot.seq
        state.num_resyncs += 1
        state.media = {DEVICE: self._bounded(snapshot.block_hashes)}
        for medium, block_hashes in snapshot.tier_block_hashes.items():
            state.media[medium] = self._bounded(block_hashes)

    def drop_replica(self, url: str) -> None:
        """Forget everything about a replica (removed, or failed: its cache is gone or unknown)."""
        self._replicas.pop(url, None)

    def _bounded(self, block_hashes: Sequence[BlockHash]) -> set[BlockHash]:
        # Bounded even if the replica's tier is larger than we were told: keep what fits.
        return set(block_hashes[: self.max_blocks_per_replica])

    @staticmethod
    def _lost(state: ReplicaKVState) -> bool:
        state.media.clear()
        state.epoch = None
        state.last_seq = 0
        return True

    @staticmethod
    def _leading_run(held: set[BlockHash], block_hashes: Sequence[BlockHash]) -> int:
        for count, block_hash in enumerate(block_hashes):
            if block_hash not in held:
                return count
        return len(block_hashes)
