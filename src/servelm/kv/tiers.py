"""KV beyond the pool, the scheduler's half: what the host (L2) and disk (L3) tiers hold, which
blocks to save, load and drop each step, and the loads in flight. The worker's half
(worker/kv_offload.py) moves the bytes and obeys.

    computed full block ──save──▶ L2 host ──┐          (write-through: saved when computed, so a
                        └─save──▶ L3 disk   │           block the pool evicts is already stored)
    admission: pool hit ─▶ lookup the next blocks in L2, then L3 ─▶ load into fresh pool blocks
               (asynchronous; the request waits in `loading`, others run; past its deadline the
               load is cancelled and whatever arrived is used, the rest computed)

Per step the scheduler: `lookup` + `start_load` at admission, `cancel_expired` at schedule(),
`stored` after update() caches blocks, `take_transfers` into the SchedulerOutput, and
`finish_load` for every KVLoadResult the runner returns. Torch-free.

With KV events on, every change of what a tier holds is recorded for the router (`take_events`):
STORED when a block joins a tier's index (a save ordered, a disk file adopted), REMOVED when it
leaves (evicted, or discarded as missing or corrupt), with the tier's medium.

Which tiers a block is looked up in: the host index (this process's own L2), then the disk index,
then the disk directory itself: a file another replica wrote (shared L3) or one written before a
restart is a hit too, and joins the index.

Disaggregation (servelm.disagg) rides on the same connector:
- a consumer's pull is a load from the REMOTE medium (a producer's host tier, over the transfer):
  no index (what the producer holds is its business: a block it lacks ends the pull), a deadline
  of its own (the pull overlaps the producer's prefill), and its own cap on the pool blocks that
  pulls in flight may hold (`num_pull_blocks`);
- a producer's export is a hold on its prompt's blocks in the host tier: `export` at the request's
  arrival pins them there as they are saved, `end_export` when its prefill ends starts the hold
  timer, and the hold lets go when the pull is served (`exports_served`) or the timer runs out
  (`expire_exports`, which tells the worker to forget the export).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from servelm.config import KVTierConfig
from servelm.datatypes import KVDrop, KVExport, KVExportEnd, KVLoad, KVLoadResult, KVMedium, KVPeer, KVSave, KVTransfers
from servelm.kv.block_hash import BlockHash
from servelm.kv.block_pool import KVCacheEvent, KVEventType
from servelm.kv.disk_store import DiskBlockStore
from servelm.kv.tier_index import TierIndex, TierIndexError

# Bandwidths assumed until a tier has been measured (bytes/s): optimistic, so the first loads
# happen and measure the real figure.
INITIAL_BANDWIDTH = {KVMedium.HOST: 4e9, KVMedium.DISK: 1e9, KVMedium.REMOTE: 1e9}
# Weight of the newest measurement in the moving averages of load bandwidth.
BANDWIDTH_EWMA = 0.2


@dataclass
class TierCounters:
    """Cumulative (Prometheus counters), per medium of the tiers beyond the pool."""

    queried_tokens: dict[KVMedium, int] = field(default_factory=dict)  # looked up there after the tiers above missed
    hit_tokens: dict[KVMedium, int] = field(default_factory=dict)  # ... and loaded from there
    loaded_bytes: dict[KVMedium, int] = field(default_factory=dict)
    saved_bytes: dict[KVMedium, int] = field(default_factory=dict)
    failed_loads: int = 0  # loads that stopped short (cancelled, missing or corrupt block)

    def add(self, counter: dict[KVMedium, int], medium: KVMedium, amount: int) -> None:
        counter[medium] = counter.get(medium, 0) + amount


@dataclass
class _Load:
    request: KVLoad
    deadline: float
    cancelled: bool = False


@dataclass
class _Hold:
    """A producer's export: its blocks stay pinned in the host tier until pulled or expired."""

    block_hashes: list[BlockHash]
    pinned: list[BlockHash] = field(default_factory=list)  # those pinned so far (saved to the host tier)
    unsaved: set[BlockHash] = field(default_factory=set)  # the rest: pinned as each is saved
    expires: float | None = None  # set when its prefill ends


class KVTiers:
    """The scheduler's view of L2/L3. Not thread-safe: the scheduler is the only caller."""

    def __init__(
        self,
        config: KVTierConfig,
        block_size: int,
        block_bytes: int,  # bytes of one block's KV in every tensor the runner moves
        disk_store: DiskBlockStore | None = None,  # required when config.disk_path is set
        enable_kv_events: bool = False,  # record STORED / REMOVED per tier (take_events), as the pool does
        remote: bool = False,  # loads may come from the REMOTE medium (a disaggregation consumer)
    ) -> None:
        if not (config.enabled or remote):
            raise ValueError("KVTiers needs a host or disk tier (KVTierConfig.enabled) or remote loads")
        if (disk_store is None) != (config.disk_path is None):
            raise ValueError("a disk store is needed exactly when config.disk_path is set")
        self.config = config
        self.block_size = block_size
        self.block_bytes = block_bytes
        self._transfers = KVTransfers()
        self.enable_kv_events = enable_kv_events
        self._events: list[KVCacheEvent] = []
        self.indexes: dict[KVMedium, TierIndex] = {}
        if config.host_bytes:
            self.indexes[KVMedium.HOST] = TierIndex(max(1, config.host_bytes // block_bytes))
        self._disk = disk_store
        if disk_store is not None:
            capacity = max(1, config.disk_bytes // disk_store.file_bytes(block_bytes))
            self.indexes[KVMedium.DISK] = TierIndex(capacity)
            for stored in sorted(disk_store.scan(), key=lambda f: f.mtime):  # oldest first: LRU order
                self._add(KVMedium.DISK, stored.block_hash)  # over capacity: the oldest are dropped
        self._loads: dict[str, _Load] = {}
        self.counters = TierCounters()
        self._bandwidth = dict(INITIAL_BANDWIDTH)
        self.remote = remote
        self._holds: dict[str, _Hold] = {}  # producer: transfer id → its export's hold
        self._num_holds: dict[BlockHash, int] = {}  # producer: holds per block hash (pinned once each)

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def has_pending(self) -> bool:
        """Orders not yet taken, or loads in flight: the engine must keep stepping."""
        return not self._transfers.is_empty or bool(self._loads)

    # -- admission ---------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash], first_block: int, max_blocks: int) -> list[KVMedium]:
        """Where blocks first_block, first_block + 1, ... are stored (nearest tier first), up to the
        first one no tier holds, at most `max_blocks`. Changes nothing but the disk index (a file
        found on disk joins it)."""
        media: list[KVMedium] = []
        for block_hash in block_hashes[first_block : first_block + max(0, max_blocks)]:
            medium = self._where(block_hash)
            if medium is None:
                break
            media.append(medium)
        return media

    def worth_loading(self, media: Sequence[KVMedium], compute_seconds: Sequence[float] | None) -> int:
        """How many of the looked-up blocks to load rather than compute. `compute_seconds[i]` is
        what computing block i is expected to cost (the step-cost model's price of its tokens and
        attention pairs at its depth); None: no estimate yet. Under the "cost" policy: all of them
        while each block's bytes over its tier's measured bandwidth beat computing it (no estimate:
        all), else the leading blocks up to the first slower one. Under "always": all of them."""
        if compute_seconds is None or self.config.kv_load_policy == "always":
            return len(media)
        for count, (medium, compute_s) in enumerate(zip(media, compute_seconds, strict=True)):
            if self.block_bytes / self._bandwidth[medium] > compute_s:
                return count
        return len(media)

    def record_query(self, num_tokens_beyond_pool: int, media: Sequence[KVMedium]) -> None:
        """An admitted request looked up `num_tokens_beyond_pool` tokens past its pool hit: count
        the queries per tier (each tier is queried for what the tiers before it missed)."""
        remaining = num_tokens_beyond_pool
        for medium in self.indexes:
            self.counters.add(self.counters.queried_tokens, medium, remaining)
            remaining -= sum(1 for m in media if m is medium) * self.block_size

    def start_load(
        self, request_id: str, block_ids: list[int], block_hashes: list[BlockHash], media: list[KVMedium], now: float
    ) -> None:
        """Order the load of `block_hashes` (from `media`) into the request's fresh `block_ids`;
        its blocks are pinned in their tiers until `finish_load`."""
        self._check_load(request_id, block_ids, block_hashes, media)
        if KVMedium.REMOTE in media:
            raise ValueError("a load from the REMOTE medium is a pull: start_pull")
        for block_hash, medium in zip(block_hashes, media, strict=True):
            self.indexes[medium].pin([block_hash])
        timeout = self.config.load_timeout_base_s + self.config.load_timeout_per_1k_tokens_s * (
            len(block_ids) * self.block_size / 1024
        )
        self._order_load(KVLoad(request_id, block_ids, block_hashes, media), now + timeout)

    def start_pull(
        self, request_id: str, block_ids: list[int], block_hashes: list[BlockHash], peer: KVPeer, deadline: float
    ) -> None:
        """Order the pull of `block_hashes` from a producer (`peer`) into the request's fresh
        `block_ids`, cancelled at `deadline` (monotonic, the scheduler's clock) if not done."""
        media = [KVMedium.REMOTE] * len(block_ids)
        self._check_load(request_id, block_ids, block_hashes, media)
        if not self.remote:
            raise ValueError("this engine does not pull KV (KVTiers(remote=False))")
        self._order_load(KVLoad(request_id, block_ids, block_hashes, media, peer), deadline)

    @property
    def num_pulling(self) -> int:
        """Pulls in flight."""
        return sum(1 for load in self._loads.values() if load.request.peer is not None)

    @property
    def num_pull_blocks(self) -> int:
        """Pool blocks held by pulls in flight."""
        return sum(len(load.request.block_ids) for load in self._loads.values() if load.request.peer is not None)

    def _check_load(
        self, request_id: str, block_ids: list[int], block_hashes: list[BlockHash], media: list[KVMedium]
    ) -> None:
        if request_id in self._loads:
            raise ValueError(f"request {request_id!r} is already loading")
        if not len(block_ids) == len(block_hashes) == len(media) > 0:
            raise ValueError(f"load of {len(block_ids)} blocks, {len(block_hashes)} hashes, {len(media)} media")

    def _order_load(self, load: KVLoad, deadline: float) -> None:
        self._loads[load.request_id] = _Load(load, deadline=deadline)
        self._transfers.loads.append(load)

    def cancel(self, request_id: str) -> None:
        """Stop a load (its request was aborted, or it is late); its result still arrives."""
        load = self._loads.get(request_id)
        if load is not None and not load.cancelled:
            load.cancelled = True
            self._transfers.cancels.append(request_id)

    def cancel_expired(self, now: float) -> list[str]:
        """Cancel the loads past their deadline; returns their request ids."""
        late = [rid for rid, load in self._loads.items() if not load.cancelled and now >= load.deadline]
        for request_id in late:
            self.cancel(request_id)
        return late

    def finish_load(self, result: KVLoadResult) -> KVLoad:
        """A load ended (the runner's report): unpin, count, learn the bandwidth, and forget blocks
        that turned out missing or corrupt. Returns the load as ordered."""
        load = self._loads.pop(result.request_id).request
        indexed = load.peer is None  # a pull's blocks are the producer's: no index here
        for block_hash, medium in zip(load.block_hashes, load.media, strict=True):
            if indexed:
                self.indexes[medium].unpin([block_hash])
        loaded = result.num_blocks_loaded
        for block_hash, medium in zip(load.block_hashes[:loaded], load.media[:loaded], strict=True):
            if indexed:
                self.indexes[medium].hit(block_hash)
            self.counters.add(self.counters.hit_tokens, medium, self.block_size)
            self.counters.add(self.counters.loaded_bytes, medium, self.block_bytes)
        if result.failure is not None:
            self.counters.failed_loads += 1
            if indexed and result.failure != "cancelled" and loaded < len(load.block_hashes):
                # The block that failed is not there (or not usable): forget it, and drop its file.
                failed_hash, failed_medium = load.block_hashes[loaded], load.media[loaded]
                if self.indexes[failed_medium].discard(failed_hash):
                    self._transfers.drops.append(KVDrop(failed_hash, failed_medium))
                    self._emit(KVEventType.REMOVED, failed_hash, failed_medium)
        if loaded and result.seconds > 0:
            medium = load.media[0]
            measured = result.num_bytes / result.seconds
            self._bandwidth[medium] += BANDWIDTH_EWMA * (measured - self._bandwidth[medium])
        return load

    # -- saving ------------------------------------------------------------------------

    def stored(self, blocks: Sequence[tuple[int, BlockHash]], retention: str = "normal") -> None:
        """Blocks the pool just cached (computed, full; (block id, hash)) by a request of this KV
        retention: order their copies into every tier that lacks them (a tier that has one keeps
        it, at the higher retention). A tier evicting to make room orders drops."""
        for block_id, block_hash in blocks:
            media = []
            for medium, index in self.indexes.items():
                if block_hash in index:
                    index.add(block_hash, retention)
                    continue
                if self._add(medium, block_hash, retention):
                    media.append(medium)
            if media:
                self._transfers.saves.append(KVSave(block_id, block_hash, tuple(media)))

    # -- exports (disaggregation, producer side) ------------------------------------------

    def export(self, transfer_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """A producer request arrived: hold its prompt's blocks `block_hashes` in the host tier as
        they are saved (pinned: never evicted before the pull), and tell the worker to serve them
        under `transfer_id`. An id already held is ignored."""
        if KVMedium.HOST not in self.indexes:
            raise ValueError("exports need the host tier (KVTierConfig.host_bytes > 0)")
        if transfer_id in self._holds:
            return
        hold = _Hold(list(block_hashes), unsaved=set(block_hashes))
        self._holds[transfer_id] = hold
        for block_hash in hold.block_hashes:
            self._num_holds[block_hash] = self._num_holds.get(block_hash, 0) + 1
            if block_hash in self.indexes[KVMedium.HOST]:
                self._pin_held(hold, block_hash)
        self._transfers.exports.append(KVExport(transfer_id, hold.block_hashes))

    def end_export(self, transfer_id: str, why: KVExportEnd, expires: float) -> None:
        """The producer request's prefill ended (COMPLETE) or failed (ABORTED): every block it will
        save has been ordered; its hold lasts until `expires` unless the pull is served first."""
        hold = self._holds.get(transfer_id)
        if hold is None or hold.expires is not None:
            return
        hold.expires = expires
        self._transfers.export_ends.append((transfer_id, why))

    def exports_served(self, transfer_ids: Sequence[str]) -> None:
        """The worker reports these exports pulled: let go of their blocks (they stay in the host
        tier, evictable) and tell the worker to forget the export."""
        for transfer_id in transfer_ids:
            if self._release(transfer_id):
                self._transfers.export_ends.append((transfer_id, KVExportEnd.EXPIRED))

    def expire_exports(self, now: float) -> list[str]:
        """Forget the exports whose hold ran out (the consumer recomputes what it did not pull)."""
        late = [tid for tid, hold in self._holds.items() if hold.expires is not None and now >= hold.expires]
        for transfer_id in late:
            self._release(transfer_id)
            self._transfers.export_ends.append((transfer_id, KVExportEnd.EXPIRED))
        return late

    @property
    def num_exports(self) -> int:
        return len(self._holds)

    def _pin_held(self, hold: _Hold, block_hash: BlockHash) -> None:
        self.indexes[KVMedium.HOST].pin([block_hash])
        hold.pinned.append(block_hash)
        hold.unsaved.discard(block_hash)

    def _release(self, transfer_id: str) -> bool:
        """Let go of an export's hold; False when there was none."""
        hold = self._holds.pop(transfer_id, None)
        if hold is None:
            return False
        self.indexes[KVMedium.HOST].unpin(hold.pinned)
        for block_hash in hold.block_hashes:
            self._num_holds[block_hash] -= 1
            if not self._num_holds[block_hash]:
                del self._num_holds[block_hash]
        return True

    def record_saved(self, saved_bytes: dict[KVMedium, int]) -> None:
        for medium, num_bytes in saved_bytes.items():
            self.counters.add(self.counters.saved_bytes, medium, num_bytes)

    def take_transfers(self) -> KVTransfers:
        """This step's orders (the next call starts afresh)."""
        transfers, self._transfers = self._transfers, KVTransfers()
        return transfers

    def take_events(self) -> list[KVCacheEvent]:
        """What the tiers started / stopped holding since the last call, oldest first ([] with
        events off). Calling it twice returns [] the second time."""
        events, self._events = self._events, []
        return events

    # -- internals -----------------------------------------------------------------------

    def _where(self, block_hash: BlockHash) -> KVMedium | None:
        for medium, index in self.indexes.items():
            if block_hash in index:
                return medium
        if self._disk is not None and KVMedium.DISK in self.indexes and self._disk.exists(block_hash):
            if self._add(KVMedium.DISK, block_hash):  # another replica's, or written before a restart
                return KVMedium.DISK
        return None

    def _add(self, medium: KVMedium, block_hash: BlockHash, retention: str = "normal") -> bool:
        """Put a block in a tier's index at `retention`, ordering drops of the blocks evicted to make
        room. Returns whether the tier holds it now (not when it is full of pinned blocks)."""
        index = self.indexes[medium]
        is_new = block_hash not in index
        added, evicted = index.add(block_hash, retention)
        for victim in evicted:
            self._transfers.drops.append(KVDrop(victim, medium))
            self._emit(KVEventType.REMOVED, victim, medium)
        if added and is_new:
            self._emit(KVEventType.STORED, block_hash, medium)
            if medium is KVMedium.HOST and block_hash in self._num_holds:
                for hold in self._holds.values():  # few at a time: one per prefill in flight
                    if block_hash in hold.unsaved:
                        self._pin_held(hold, block_hash)
        return added

    def _emit(self, event_type: KVEventType, block_hash: BlockHash, medium: KVMedium) -> None:
        if self.enable_kv_events:
            self._events.append(KVCacheEvent(event_type, block_hash, None, medium))

    def check_invariants(self) -> None:
        for index in self.indexes.values():
            index.check_invariants()
        pinned: dict[KVMedium, set[BlockHash]] = {medium: set() for medium in self.indexes}
        for load in self._loads.values():
            if load.request.peer is not None:
                continue  # a pull: the producer's blocks
            pinned_here = zip(load.request.block_hashes, load.request.media, strict=True)
            for block_hash, medium in pinned_here:
                pinned[medium].add(block_hash)
        for hold in self._holds.values():
            pinned[KVMedium.HOST].update(hold.pinned)
        for medium, hashes in pinned.items():
            if any(not self.indexes[medium].is_pinned(h) for h in hashes):
                raise TierIndexError(f"a loading or exported block is not pinned in the {medium.value} tier")
        held = Counter(h for hold in self._holds.values() for h in hold.block_hashes)
        if dict(held) != self._num_holds:
            raise TierIndexError("the per-block hold counts disagree with the holds")
