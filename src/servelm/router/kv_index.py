"""Exact index of the replicas' prefix caches, mirrored from their KV events.

    block hash ──▶ {replica URL, ...}        (which replicas can serve this block now)
    replica URL ──▶ ReplicaKVState           (its hashes, its publisher epoch, last seq applied)

Fed by kv_subscriber.py with each replica's KVEventBatch stream (servelm.schemas.kv_events).
The stream is lossy (ZMQ PUB drops), so every batch is checked against the replica's
sequence number: a hole, a new epoch, or a heartbeat ahead of what was applied means
something was lost. Then the replica's entries are dropped at once (a wrong index is
worse than an empty one) and `apply_batch` says so; the caller fetches a snapshot and
hands it to `apply_snapshot`, after which batches continue from the snapshot's seq.

Bounded: a replica holds at most `max_blocks_per_replica` hashes (set it to at least
the replicas' KV pool size). More than that can only mean a corrupted stream, which is
treated like a hole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from servelm.kv.block_hash import BlockHash
from servelm.schemas.kv_events import CLEARED, REMOVED, STORED, KVEventBatch, KVSnapshot


@dataclass
class ReplicaKVState:
    epoch: str | None = None  # publisher epoch the state below belongs to; None: not synced
    last_seq: int = 0  # last batch applied (or the snapshot's seq)
    block_hashes: set[BlockHash] = field(default_factory=set)
    num_resyncs: int = 0


class KVIndex:
    def __init__(self, max_blocks_per_replica: int = 1 << 20) -> None:
        if max_blocks_per_replica <= 0:
            raise ValueError(f"max_blocks_per_replica must be positive, got {max_blocks_per_replica}")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._owners: dict[BlockHash, set[str]] = {}
        self._replicas: dict[str, ReplicaKVState] = {}

    # -- queries ---------------------------------------------------------------------

    def match(self, url: str, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` the replica holds (0 while it is not synced)."""
        matched = 0
        for block_hash in block_hashes:
            owners = self._owners.get(block_hash)
            if owners is None or url not in owners:
                break
            matched += 1
        return matched

    def is_synced(self, url: str) -> bool:
        state = self._replicas.get(url)
        return state is not None and state.epoch is not None

    def replica_size(self, url: str) -> int:
        state = self._replicas.get(url)
        return len(state.block_hashes) if state is not None else 0

    def num_hashes(self) -> int:
        """Distinct hashes held by any replica."""
        return len(self._owners)

    def state(self, url: str) -> ReplicaKVState | None:
        return self._replicas.get(url)

    # -- updates ---------------------------------------------------------------------

    def apply_batch(self, url: str, batch: KVEventBatch) -> bool:
        """Apply one batch from `url`'s publisher. Returns True when the replica needs a snapshot.

        Old or duplicate batches (seq <= last applied, same epoch) are ignored.
        """
        state = self._replicas.setdefault(url, ReplicaKVState())
        if state.epoch != batch.epoch:
            return self._lost(url, state)
        if not batch.events:  # heartbeat: says which seq we should have reached
            return self._lost(url, state) if batch.seq > state.last_seq else False
        if batch.seq <= state.last_seq:
            return False
        if batch.seq != state.last_seq + 1:
            return self._lost(url, state)
        for record in batch.events:
            if record.kind == STORED:
                self._add(url, state, record.block_hash)
            elif record.kind == REMOVED:
                self._discard(url, state, record.block_hash)
            elif record.kind == CLEARED:
                self._clear(url, state)
        state.last_seq = batch.seq
        if len(state.block_hashes) > self.max_blocks_per_replica:
            return self._lost(url, state)
        return False

    def apply_snapshot(self, url: str, snapshot: KVSnapshot) -> None:
        """Replace the replica's entries with the snapshot; batches resume after `snapshot.seq`."""
        state = self._replicas.setdefault(url, ReplicaKVState())
        self._clear(url, state)
        state.epoch = snapshot.epoch
        state.last_seq = snapshot.seq
        state.num_resyncs += 1
        # Bounded even if the replica's pool is larger than we were told: keep what fits.
        for block_hash in snapshot.block_hashes[: self.max_blocks_per_replica]:
            self._add(url, state, block_hash)

    def drop_replica(self, url: str) -> None:
        """Forget everything about a replica (removed, or failed: its cache is gone or unknown)."""
        state = self._replicas.pop(url, None)
        if state is not None:
            self._clear(url, state)

    def _lost(self, url: str, state: ReplicaKVState) -> bool:
        self._clear(url, state)
        state.epoch = None
        state.last_seq = 0
        return True

    def _add(self, url: str, state: ReplicaKVState, block_hash: BlockHash) -> None:
        state.block_hashes.add(block_hash)
        self._owners.setdefault(block_hash, set()).add(url)

    def _discard(self, url: str, state: ReplicaKVState, block_hash: BlockHash) -> None:
        state.block_hashes.discard(block_hash)
        owners = self._owners.get(block_hash)
        if owners is not None:
            owners.discard(url)
            if not owners:
                del self._owners[block_hash]

    def _clear(self, url: str, state: ReplicaKVState) -> None:
        for block_hash in list(state.block_hashes):
            self._discard(url, state, block_hash)
