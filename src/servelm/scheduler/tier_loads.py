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

Disaggregation takes the same road. A consumer request (kv_transfer role CONSUMER) pulls the
prompt's blocks past its pool hit from the producer named in its params, once, the same way: it
waits in `loading` while they stream in (the producer may still be computing them), then
computes the rest. Pulls in flight hold at most `max_pull_blocks` pool blocks: a request whose
pull does not fit under that cap waits (DEFER) rather than starving running streams, up to the
producer's hold time, after which it computes its prompt itself. A producer request (role
PRODUCER) exports its prompt's blocks: held in the host tier from its arrival until pulled or
until kv_transfer_hold_s after its prefill ends.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from servelm.config import KVTransferConfig
from servelm.datatypes import (
    EventType,
    KVExportEnd,
    KVLoadResult,
    KVMedium,
    KVPeer,
    KVTransferRole,
    KVTransfers,
)
from servelm.kv.block_hash import hash_block_tokens
from servelm.kv.kv_cache_manager import ComputedBlocks, KVCacheManager
from servelm.kv.tiers import KVTiers
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.step_cost import StepCostModel


class Admission(enum.Enum):
    """What try_start made of a waiting request."""

    COMPUTE = "compute"  # admit it now; it computes what the pool lacks
    LOADING = "loading"  # off the queue: it waits for its KV (a tier load or a pull)
    DEFER = "defer"  # leave it waiting this step: its pull has no room under the cap yet


def _role(request: Request) -> KVTransferRole | None:
    return request.kv_transfer.role if request.kv_transfer is not None else None


class TierLoads:
    """The Scheduler's link to KVTiers: starts loads at admission, ends them, and forwards the
    pool's newly cached blocks to be saved. The Scheduler is the only caller."""

    def __init__(self, tiers: KVTiers, kv: KVCacheManager, transfer: KVTransferConfig | None = None) -> None:
        self.tiers = tiers
        self._kv = kv
        self.transfer = transfer if transfer is not None else KVTransferConfig()
        configured_cap = self.transfer.kv_transfer_max_reserved_blocks
        self.max_pull_blocks = configured_cap if configured_cap is not None else max(1, kv.num_blocks // 2)
        self.loading: dict[str, Request] = {}
        self._status_before: dict[str, RequestStatus] = {}  # WAITING or PREEMPTED, restored after

    def __len__(self) -> int:
        return len(self.loading)

    def has_pending(self) -> bool:
        return self.tiers.has_pending()

    def try_start(self, request: Request, hit: ComputedBlocks, step_cost: StepCostModel, now: float) -> Admission:
        """At admission, after the pool lookup `hit`: a consumer's first admission pulls (or
        defers); otherwise start loading the blocks that follow the hit from the tiers when that
        beats computing them (`step_cost`'s price of each block's tokens and attention pairs) and the pool
        has room."""
        if _role(request) is KVTransferRole.CONSUMER and not request.pull_tried:
            return self._try_pull(request, hit, now)
        return Admission.LOADING if self._try_load(request, hit, step_cost, now) else Admission.COMPUTE

    def _try_load(self, request: Request, hit: ComputedBlocks, step_cost: StepCostModel, now: float) -> bool:
        if request.tiers_looked_up or not hit.block_hashes or not self.tiers.indexes:
            return False
        num_hit_blocks = len(hit.blocks)
        # The last token is always computed (its logits), as in the pool lookup.
        max_blocks = (request.num_tokens - 1) // self._kv.block_size - num_hit_blocks
        media = self.tiers.lookup(hit.block_hashes, num_hit_blocks, max_blocks)
        if not media:
            return False
        block_size = self._kv.block_size
        # A regression over the recent steps: asked only when a tier holds something.
        compute_seconds = step_cost.prompt_blocks_s(block_size, num_hit_blocks * block_size, len(media))
        media = media[: self.tiers.worth_loading(media, compute_seconds)]
        # A pool too full for the whole load still takes its leading blocks: the rest is computed.
        room = self._kv.max_new_tokens(
            request.request_id, num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit
        )
        media = media[: max(0, room) // self._kv.block_size]
        if not media:
            return False
        block_ids = self._kv.allocate_slots(
            request.request_id, len(media) * self._kv.block_size,
            num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit, record_query=False,
        )  # fmt: skip
        if block_ids is None:
            return False  # no room now; it is admitted (or tried again) as usual
        request.tiers_looked_up = True
        self.tiers.record_query(request.num_tokens - hit.num_computed_tokens, media)
        hashes = list(hit.block_hashes[num_hit_blocks : num_hit_blocks + len(media)])
        self.tiers.start_load(request.request_id, block_ids[num_hit_blocks:], hashes, media, now)
        self._wait_for_kv(request, EventType.KV_LOAD_STARTED, len(media), now)
        return True

    def _try_pull(self, request: Request, hit: ComputedBlocks, now: float) -> Admission:
        """A consumer's pull of the blocks after its pool hit, as many as the pool has room for;
        DEFER while the cap on blocks held by pulls leaves too few, COMPUTE when there is nothing
        to pull, the producer's hold has surely run out, or the pool has no room."""
        params = request.kv_transfer
        assert params is not None and params.peer is not None  # the API checks consumers name a peer
        block_size = self._kv.block_size
        num_hit_blocks = len(hit.blocks)
        wanted = (request.num_tokens - 1) // block_size - num_hit_blocks
        room = self._kv.max_new_tokens(
            request.request_id, num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit
        )
        num_blocks = min(wanted, max(0, room) // block_size)
        if num_blocks <= 0 or now - request.arrival_time >= self.transfer.kv_transfer_hold_s:
            request.pull_tried = True
            return Admission.COMPUTE
        if self.tiers.num_pull_blocks + num_blocks > self.max_pull_blocks:
            return (
                Admission.DEFER if self.tiers.num_pull_blocks else Admission.COMPUTE
            )  # a lone pull over the cap: compute
        block_ids = self._kv.allocate_slots(
            request.request_id, num_blocks * block_size,
            num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit, record_query=False,
        )  # fmt: skip
        if block_ids is None:
            return Admission.COMPUTE
        request.pull_tried = True
        hashes = list(hit.block_hashes[num_hit_blocks : num_hit_blocks + num_blocks])
        peer = KVPeer(params.peer, params.transfer_id)
        deadline = now + self.transfer.kv_transfer_timeout_s
        self.tiers.start_pull(request.request_id, block_ids[num_hit_blocks:], hashes, peer, deadline)
        self._wait_for_kv(request, EventType.KV_PULL_STARTED, num_blocks, now)
        return Admission.LOADING

    def _wait_for_kv(self, request: Request, event: EventType, num_blocks: int, now: float) -> None:
        self._status_before[request.request_id] = request.status
        request.status = RequestStatus.LOADING_KV
        request.record(event, now, detail=num_blocks * self._kv.block_size)
        self.loading[request.request_id] = request

    # -- producer side (exports) ----------------------------------------------------------

    def arrived(self, request: Request) -> None:
        """A producer request arrived: export its prompt's blocks (those a consumer may pull:
        all full blocks but one ending on the last token, which the consumer computes)."""
        params = request.kv_transfer
        if params is None or params.role is not KVTransferRole.PRODUCER:
            return
        num_blocks = (request.num_prompt_tokens - 1) // self._kv.block_size
        if num_blocks == 0:
            return  # a prompt shorter than a block: the consumer computes it all, nothing to hold
        hashes = hash_block_tokens(request.prompt_token_ids, self._kv.block_size, request.extra_key)[:num_blocks]
        self.tiers.export(params.transfer_id, hashes)

    def admitted(self, request: Request, hit: ComputedBlocks) -> None:
        """A producer request's pool hit must be in the host tier too (the pull reads it there):
        the blocks it lacks are saved from the pool."""
        if _role(request) is KVTransferRole.PRODUCER and hit.blocks:
            hashes = hit.block_hashes[: len(hit.blocks)]
            self.stored([(block.block_id, h) for block, h in zip(hit.blocks, hashes, strict=True)], "normal")

    def finished(self, request: Request, now: float) -> None:
        """A producer request ended: what it exports is ordered saved; hold it for the pull."""
        params = request.kv_transfer
        if params is None or params.role is not KVTransferRole.PRODUCER:
            return
        computed = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        why = KVExportEnd.COMPLETE if computed else KVExportEnd.ABORTED
        self.tiers.end_export(params.transfer_id, why, now + self.transfer.kv_transfer_hold_s)

    def admitted_without_load(self, request: Request, hit: ComputedBlocks) -> None:
        """A request admitted straight from the pool: count its tier queries (all misses) once."""
        if not request.tiers_looked_up:
            request.tiers_looked_up = True
            self.tiers.record_query(request.num_tokens - hit.num_computed_tokens, [])

    def expire(self, now: float) -> None:
        """Cancel the loads past their deadline (their results come back with what arrived), and
        let go of the exports whose hold ran out."""
        self.tiers.cancel_expired(now)
        self.tiers.expire_exports(now)

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
            ended = EventType.KV_PULLED if load.peer is not None else EventType.KV_LOADED
            request.record(ended, now, detail=result.num_blocks_loaded * block_size)
            arrived.append(request)
        return arrived

    def exports_served(self, transfer_ids: Sequence[str]) -> None:
        if transfer_ids:
            self.tiers.exports_served(transfer_ids)

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
