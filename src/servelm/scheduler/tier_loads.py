"""Requests waiting for their prefix's KV to arrive from a tier beyond the pool (kv/tiers.py).

    waiting ──admission: pool hit + tier hit worth loading──▶ loading (holds the pool-hit blocks and
       ▲                                                        fresh blocks for the load)
       └──── the load ended (complete, partial, cancelled) ◀───┘
             the loaded blocks join the prefix cache and are released; the request goes back to
             waiting and its next admission hits them in the pool, computing only the rest

Between the two admissions nothing runs for the request and its blocks count as used: other
requests run meanwhile (the load is on the runner's loader thread). A load past its deadline is
cancelled and whatever arrived is used; a request tries the tiers once per admission (again after
a preemption: its blocks were saved when computed, so it swaps back in instead of recomputing).
"""

from __future__ import annotations

from collections.abc import Sequence

from servelm.datatypes import EventType, KVLoadResult, KVMedium, KVTransfers
from servelm.kv.kv_cache_manager import ComputedBlocks, KVCacheManager
from servelm.kv.tiers import KVTiers
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.step_cost import StepCostModel


class TierLoads:
    """The Scheduler's link to KVTiers: starts loads at admission, ends them, and forwards the
    pool's newly cached blocks to be saved. The Scheduler is the only caller."""

    def __init__(self, tiers: KVTiers, kv: KVCacheManager) -> None:
        self.tiers = tiers
        self._kv = kv
        self.loading: dict[str, Request] = {}
        self._status_before: dict[str, RequestStatus] = {}  # WAITING or PREEMPTED, restored after

    def __len__(self) -> int:
        return len(self.loading)

    def has_pending(self) -> bool:
        return self.tiers.has_pending()

    def try_start(self, request: Request, hit: ComputedBlocks, step_cost: StepCostModel, now: float) -> bool:
        """At admission, after the pool lookup `hit`: start loading the blocks that follow it from
        the tiers when that beats computing them (`step_cost`'s prefill time per token) and the pool
        has room. True: the request is now loading (off the waiting queue, holding blocks)."""
        if request.tiers_looked_up or not hit.block_hashes:
            return False
        num_hit_blocks = len(hit.blocks)
        # The last token is always computed (its logits), as in the pool lookup.
        max_blocks = (request.num_tokens - 1) // self._kv.block_size - num_hit_blocks
        media = self.tiers.lookup(hit.block_hashes, num_hit_blocks, max_blocks)
        if not media:
            return False
        fit = step_cost.current()  # a regression over the recent steps: only when a tier holds something
        media = media[: self.tiers.worth_loading(media, fit[1] if fit is not None else None)]
        # A pool too full for the whole load still takes its leading blocks: the rest is computed.
        room = self._kv.max_new_tokens(
            request.request_id, num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit
        )
        media = media[: max(0, room) // self._kv.block_size]
        if not media:
            return False
        block_ids = self._kv.allocate_slots(
            request.request_id, len(media) * self._kv.block_size,
            num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit,
        )  # fmt: skip
        if block_ids is None:
            return False  # no room now; it is admitted (or tried again) as usual
        request.tiers_looked_up = True
        self.tiers.record_query(request.num_tokens - hit.num_computed_tokens, media)
        hashes = list(hit.block_hashes[num_hit_blocks : num_hit_blocks + len(media)])
        self.tiers.start_load(request.request_id, block_ids[num_hit_blocks:], hashes, media, now)
        self._status_before[request.request_id] = request.status
        request.status = RequestStatus.LOADING_KV
        request.record(EventType.KV_LOAD_STARTED, now, detail=len(media) * self._kv.block_size)
        self.loading[request.request_id] = request
        return True

    def admitted_without_load(self, request: Request, hit: ComputedBlocks) -> None:
        """A request admitted straight from the pool: count its tier queries (all misses) once."""
        if not request.tiers_looked_up:
            request.tiers_looked_up = True
            self.tiers.record_query(request.num_tokens - hit.num_computed_tokens, [])

    def expire(self, now: float) -> None:
        """Cancel the loads past their deadline (their results come back with what arrived)."""
        self.tiers.cancel_expired(now)

    def abort(self, request: Request) -> None:
        """A loading request is finishing (aborted): cancel its load. The caller frees its blocks:
        the runner applies the cancel before any forward could reuse them."""
        self.tiers.cancel(request.request_id)
        self.loading.pop(request.request_id, None)
        self._status_before.pop(request.request_id, None)

    def finish(self, results: Sequence[KVLoadResult], now: float) -> list[Request]:
        """Apply the runner's ended loads; returns the requests to put back in the waiting queue."""
        arrived = []
        for result in results:
            load = self.tiers.finish_load(result)
            request = self.loading.pop(result.request_id, None)
            if request is None:
                continue  # aborted while loading: its blocks are already free
            block_size = self._kv.block_size
            num_hit_blocks = len(self._kv.get_block_ids(request.request_id)) - len(load.block_ids)
            num_valid_tokens = (num_hit_blocks + result.num_blocks_loaded) * block_size
            # The loaded blocks join the prefix cache (and tiers that lack them: a disk block is
            # promoted to host memory), then the request lets go of everything it holds.
            cached = self._kv.cache_full_blocks(
                request.request_id, request.all_token_ids, num_valid_tokens, request.slo.tenant
            )
            self.stored(cached, request.slo.kv_retention)
            self._kv.free(request.request_id)
            request.status = self._status_before.pop(request.request_id)
            request.record(EventType.KV_LOADED, now, detail=result.num_blocks_loaded * block_size)
            arrived.append(request)
        return arrived

    def stored(self, blocks: Sequence[tuple[int, bytes]], retention: str) -> None:
        if blocks:
            self.tiers.stored(blocks, retention)

    def record_saved(self, saved_bytes: dict[KVMedium, int]) -> None:
        self.tiers.record_saved(saved_bytes)

    def take_transfers(self) -> KVTransfers:
        return self.tiers.take_transfers()

    def check_invariants(self) -> None:
        self.tiers.check_invariants()
        for request_id, request in self.loading.items():
            if request.status is not RequestStatus.LOADING_KV or not self._kv.get_block_ids(request_id):
                raise RuntimeError(f"loading {request_id!r} is {request.status.value} or holds no blocks")
        if set(self._status_before) != set(self.loading):
            raise RuntimeError("loading requests and their saved statuses disagree")
