"""EngineCore: the step loop. schedule → execute → update, and nothing else.

Runs wherever it is put: in the caller's process (offline LLM, tests) or in its own
process behind ZMQ (the server). It never tokenizes or detokenizes.

A step whose execution raises fails only the request to blame (an ERROR output, its blocks
freed, the traceback logged): the step's requests are retried one by one, alone, and the one
that raises again fails while the others run on; the engine serves the next step as usual.
The fronts validate inputs first; this is what keeps one bad request (or a bug it triggers)
from poisoning every later step, or the requests that shared its step. A step that runs out of
device memory (torch.OutOfMemoryError) goes the same way: alone, each request's step is smaller,
and a request that does not fit even alone fails with an error that says so.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from concurrent import futures

import torch

from servelm.config import LoRAModule
from servelm.datatypes import EngineOutput, EngineRequest, KVMedium, ModelOutput, SchedulerOutput
from servelm.kv.kv_cache_manager import KVCacheManager
from servelm.kv.tiers import KVTiers
from servelm.lora.adapter import LoRAAdapterError
from servelm.lora.registry import LoadCall
from servelm.lora.slots import LoRASlots
from servelm.scheduler.scheduler import Scheduler
from servelm.schemas.core_stats import QUEUED_AFTER_S, CoreStats, TierStats
from servelm.structured.masks import MaskFiller
from servelm.worker.host_residency import HostResidency
from servelm.worker.model_runner import ModelRunner
from servelm.worker.multi_rank import RankFailedError

logger = logging.getLogger(__name__)

# Steps close() takes at most to carry out the last KV transfers (loads in flight end within
# their deadlines; saves take one step).
CLOSE_MAX_STEPS = 1000
# Longest an idle step waits for a grammar compile (new requests and aborts are read between steps).
GRAMMAR_WAIT_S = 0.02


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        kv_manager: KVCacheManager,
        residencies: Sequence[HostResidency] = (),
        mask_filler: MaskFiller | None = None,  # structured outputs' token masks (None: none)
        lora: LoRASlots | None = None,  # the LoRA adapters served and the runner's slots (None: no LoRA)
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv_manager = kv_manager  # read-only here: for stats and invariant checks
        # CPU: the weights and the KV pool, each kept warm at its own interval (worker/host_residency.py)
        self.residencies = list(residencies)
        self.mask_filler = mask_filler
        self.lora = lora

    def keep_warm(self) -> bool:
        """Between steps, idle or not: read the next slice of the pages due (ModelConfig.keep_warm_s:
        the weights; the KV pool at KV_POOL_WARM_FACTOR times that), one slice a call, the weights
        first. Returns whether pages are still due (an idle caller should call again soon rather
        than wait for input); a no-op without residencies."""
        for residency in self.residencies:
            if residency.maybe_touch():
                break
        return any(residency.has_work() for residency in self.residencies)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; ValueError for one that cannot run here (the scheduler's checks, an
        adapter this engine does not serve)."""
        if request.lora_name is not None and (self.lora is None or not self.lora.registry.is_served(request.lora_name)):
            served = ", ".join(sorted(self.lora.registry.served)) if self.lora is not None else "none (no --enable-lora)"
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not served here (served: {served or 'none'})")
        self.scheduler.add_request(request)

    # -- LoRA adapters at run time (lora/registry.py) ---------------------------------------

    def start_lora_load(self, module: LoRAModule) -> LoadCall:
        """Begin reading a run-time adapter in the background (LoRAAdapterError now for a name taken,
        or without --enable-lora); finish_lora_load() once its read is done serves it."""
        if self.lora is None:
            raise LoRAAdapterError("this server does not serve LoRA adapters (start it with --enable-lora)")
        self._settle_adapters()  # an earlier adapter of that name whose requests ended since goes now
        return self.lora.registry.start_load(module)

    def finish_lora_load(self, call: LoadCall) -> None:
        """Serve a run-time adapter whose read is done; LoRAAdapterError saying why it cannot be."""
        assert self.lora is not None
        self.lora.registry.finish_load(call, self.scheduler.running_adapters())
        self.lora.forget([call.module.name])  # a slot may still hold an earlier adapter of that name

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (KeyError if not served): requests using it run to their end."""
        if self.lora is None:
            raise KeyError(name)
        self.lora.registry.unload(name)

    def _settle_adapters(self) -> None:
        """Between steps: adapters read in the background come in, those no request uses any more
        after an unload go, and requests whose adapter could not be read again fail."""
        if self.lora is None or not self.lora.registry.needs_settling():
            return  # most steps: nothing read, unloaded or failed since (the scan of requests below is not free)
        registry = self.lora.registry
        self.lora.forget(registry.settle(self.scheduler.running_adapters(), self.scheduler.adapters_in_use()))
        for name, error in registry.take_failed_reads().items():
            self.scheduler.fail_adapter_requests(name, f"LoRA adapter {name!r} could not be read: {error}")

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_housekeeping(self) -> bool:
        """Idle, but something times out or is reported by the worker only in a step: a prefill
        worker's exports waiting for their pull (served, or expired after the hold)."""
        tiers = self.scheduler.kv_tiers
        return tiers is not None and tiers.num_exports > 0

    def transfer_gauges(self) -> tuple[int, int, int]:
        """(loading, pulling, exports held): gauges that change in steps without any output, so
        the stats go out when they move (a pull waiting seconds for its prefill shows as one)."""
        tiers = self.scheduler.kv_tiers
        return (tiers.num_loading, tiers.num_pulling, tiers.num_exports) if tiers is not None else (0, 0, 0)

    def step(self) -> list[EngineOutput]:
        self._settle_adapters()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.has_work and (awaited := self._background_work()):
            # Nothing to run but grammars or adapters to wait for: wait on them, not in a loop of
            # empty steps (which would also take the GIL from the thread doing that work).
            futures.wait(awaited, timeout=GRAMMAR_WAIT_S, return_when=futures.FIRST_COMPLETED)
        try:
            model_output = self._execute(scheduler_output)
        except RankFailedError:
            raise  # the ranks of a multi-rank worker are out of step: nothing to retry (multi_rank.py)
        except Exception as exc:  # noqa: BLE001 - contained: logged and isolated in _isolate_failure
            return self._isolate_failure(scheduler_output, exc)
        return self.scheduler.update(scheduler_output, model_output)

    def _background_work(self) -> list[futures.Future]:
        """Grammar compiles and adapter reads in flight that requests wait for."""
        reads = self.lora.registry.reads_in_flight() if self.lora is not None else []
        return [*self.scheduler.compiling_grammars(), *reads]

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """The runner runs the step while the constrained requests' token masks are filled beside it
        (structured/masks.py); the fill is over before update() advances their matchers."""
        matchers = self.scheduler.sampling_grammars(scheduler_output) if self.mask_filler is not None else []
        masks = self.mask_filler.start(matchers) if self.mask_filler is not None else None
        try:
            # (no masks: the runner's one-argument call, as every step was before structured outputs)
            return self.runner.execute(scheduler_output, masks) if masks is not None else self.runner.execute(scheduler_output)
        finally:
            if masks is not None:
                futures.wait([masks.rows])

    def _isolate_failure(self, failed_step: SchedulerOutput, exc: Exception) -> list[EngineOutput]:
        """A step raised. Alone, its request fails. With several, which one is to blame is not known:
        each is put back and run alone up to its next sample, so only the one that raises again
        fails (the others lose their KV and recompute: the price of the rare failing step)."""
        request_ids = failed_step.scheduled_request_ids
        logger.error("engine step of %d request(s) failed: %s", len(request_ids), request_ids, exc_info=exc)
        # The traceback's frames hold the failed step's tensors (activations: all of a GPU's free
        # memory after an out-of-memory error); drop them before the retries need that memory.
        traceback.clear_frames(exc.__traceback__)
        if len(request_ids) <= 1:
            return self.scheduler.fail_step(failed_step, step_error(exc))
        outputs = []
        for request_id in self.scheduler.requeue_step(failed_step):
            while (alone := self.scheduler.schedule_alone(request_id)) is not None:
                try:
                    model_output = self._execute(alone)
                except Exception as alone_exc:
                    logger.error("request %s fails alone too: failing it", request_id, exc_info=alone_exc)
                    traceback.clear_frames(alone_exc.__traceback__)
                    outputs.extend(self.scheduler.fail_step(alone, step_error(alone_exc)))
                    break
                outputs.extend(self.scheduler.update(alone, model_output))
        return outputs

    def close(self) -> None:
        """At shutdown: the KV tiers' last saves, then the other ranks of a multi-rank worker stop."""
        try:
            self._finish_saves()
        finally:
            if self.lora is not None:
                self.lora.registry.close()
            self.runner.close()

    def _finish_saves(self) -> None:
        """With no request left: carry out the KV saves still ordered (a finished request's last
        blocks) and write them to disk, so a restarted replica finds them. Bounded: requests
        still running are not waited for."""
        offloader = self.runner.kv_offloader
        if offloader is None:
            return
        scheduler = self.scheduler
        for _ in range(CLOSE_MAX_STEPS):
            idle = scheduler.num_running == 0 and scheduler.num_waiting == 0
            if not idle or not scheduler.has_unfinished_requests():
                break
            self.step()
        offloader.close()

    def stats(self) -> CoreStats:
        kv = self.kv_manager
        prefix = kv.stats
        spec = self.scheduler.spec_counters
        tiers = self.scheduler.kv_tiers
        grammars = self.scheduler.grammars
        return CoreStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_queued=self.scheduler.num_waited_for(QUEUED_AFTER_S),
            num_prefilling=self.scheduler.num_prefilling,
            kv_usage=kv.usage,
            num_used_blocks=kv.num_blocks - kv.num_free_blocks,
            prefix_queries=prefix.num_queried_tokens,
            prefix_hits=prefix.num_hit_tokens,
            prefix_evicted_misses=prefix.num_evicted_miss_tokens,
            prefix_evictions_by_tenant=dict(prefix.evicted_blocks_by_tenant),
            num_preemptions=self.scheduler.step_log.num_preemptions,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_position=list(spec.accepted_per_position) if spec else [],
            tiers=tier_stats(tiers) if tiers is not None else TierStats(),
            step_target_s=self.scheduler.step_target_s() or 0.0,
            structured_requests=self.scheduler.num_structured_requests,
            grammar_compiles=grammars.num_compiled if grammars is not None else 0,
            grammar_compile_seconds=grammars.compile_seconds if grammars is not None else 0.0,
        )

    def take_step_records(self) -> list[tuple[int, float]]:
        """(scheduled tokens, runner seconds) of the steps since the last call (Scheduler.step_log)."""
        return self.scheduler.step_log.take_records()

    def take_mask_fills(self) -> list[float]:
        """Seconds of each structured-output token-mask fill since the last call (masks.py)."""
        return self.mask_filler.take_fill_times() if self.mask_filler is not None else []

    def take_step_predictions(self) -> list[tuple[str, float, float]]:
        """(kind, predicted, measured seconds) of the steps since the last call (Scheduler.step_log)."""
        return self.scheduler.step_log.take_predictions()


def tier_stats(tiers: KVTiers) -> TierStats:
    """The KV tiers' counters and gauges, keyed by medium name."""
    counters = tiers.counters

    media = [*tiers.indexes, *([KVMedium.REMOTE] if tiers.remote else [])]

    def by_name(counter: dict[KVMedium, int]) -> dict[str, int]:
        # Every configured tier, at 0 until it counts: a counter that exists reads 0, not "absent".
        return {medium.value: counter.get(medium, 0) for medium in media}

    return TierStats(
        queries=by_name(counters.queried_tokens),
        hits=by_name(counters.hit_tokens),
        loaded_bytes=by_name(counters.loaded_bytes),
        saved_bytes=by_name(counters.saved_bytes),
        used_bytes={m.value: len(index) * tiers.block_bytes for m, index in tiers.indexes.items()},
        capacity_bytes={m.value: index.capacity_blocks * tiers.block_bytes for m, index in tiers.indexes.items()},
        failed_loads=counters.failed_loads,
        num_loading=tiers.num_loading,
        num_pulling=tiers.num_pulling,
        num_exports=tiers.num_exports,
    )


def step_error(exc: Exception) -> str:
    """What a request failed by `exc` in its step (run alone) is told. The exception's type only:
    its text may carry internals (shapes, paths) the client has no use for; the log has it all."""
    if isinstance(exc, torch.OutOfMemoryError):
        return (
            "the engine step failed: OutOfMemoryError: the request does not fit the device's memory even alone "
            "(the server needs a lower --max-num-batched-tokens or --gpu-memory-utilization)"
        )
    return f"the engine step failed: {type(exc).__name__}"
