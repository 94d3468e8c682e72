"""Scheduler: token catch-up scheduling over a paged KV cache. The one writer of request state.

Each step hands out a token budget (max_num_batched_tokens) and, where the step-cost model can
price it, a time: every step is held to a step-time target (max_step_ms; by default 10x the
calibrated fixed part of a prompt step, step_pricing.py), decodes or not, because a step is
never interrupted and whatever arrives waits for it to end; while requests decode, also to
max_decode_slowdown x what their decodes alone take, so their token gaps stay near a bare
decode's. Requests are ranked by (effective priority, deadline), effective priority =
priority - floor(age / aging_s), deadline = arrival + the class's TTFT target, with fair share
between the tenants of a class (ranking.py):

    1. DECODES: running requests whose prompt is computed, best rank first, each get
       min(num_tokens - num_computed_tokens, budget left), never cut by time. They go before any
       prefill, so a prompt's chunk never takes what a decode needs. No blocks → preempt the
       worst-ranked running request not yet scheduled this step (perhaps itself) and retry.
    2. PREFILL CHUNKS: running prompts mid-prefill and WAITING requests in one order, by
       (effective priority, deadline, running before waiting). In a priced step, within one
       effective priority the prompts whose rest finishes whole in the time left go first and
       the others after them, by wait per token left (the fewest tokens first while fresh, a long
       prompt catching up as it waits: _schedule_deferred): a request arriving mid-prefill joins
       the next step (decodes, short prompts, then the long prompt's next chunk). A long prompt's
       chunk is what keeps the step within its target; where a token chunk that small would spend more than a tenth of its time
       on what every chunk pays (the pass over the weights, re-reading its context), a large chunk
       runs a few layers a step instead (layered prefill: LayerSlice; its tokens count as computed
       after its last layer). The step's first prompt work moves by a block or a layer even over
       the target, so decodes filling every step never starve the prompts. A step that completes a
       prompt (its first token) ends within FIRST_TOKEN_SHARE of the target and within the
       prompt's class TBT share. Unpriced steps (no target, no fit) cap a long prompt's chunk at
       long_prefill_token_threshold and let the budget alone bind. A chunk that leaves its prompt
       unfinished takes one of max_num_partial_prefills slots (of max_long_partial_prefills if the
       prompt has more than the cap left); with no slot left the prompt sits this step out.
       Waiting requests are admitted only while nobody was preempted (blocks are short then:
       admitting would thrash), a seat and a free block remain. A running chunk without blocks
       preempts as in 1; a waiting request that does not fit is SKIPPED, never waited for.
    3. TOP-UP (unpriced steps): budget left over goes back to the chunks that left their prompt
       unfinished, then to the running prompts that sat the step out, in the order of 2, as far
       as free blocks go.

Aging never blocks: nothing waits behind a request that does not fit. Instead a request
that has waited aging_s is admitted with a first chunk shrunk to the free blocks (with
chunked prefill), so it runs as soon as any block, a seat and budget are free; once running,
its rank keeps improving with its age, so it eventually outranks every request that arrived
more than aging_s after it, whatever their deadlines (those before it or less later finish by
the same argument), and is no longer their preemption victim nor left without a slot: it
finishes. Without chunked prefill a prompt needs all its blocks at once and cannot shrink: a
starving one is still skipped while it does not fit, and ranks first whenever it does.

update() then advances num_computed_tokens by what was scheduled (a layered chunk's layers, and
its tokens once its last layer ran), caches newly full blocks, appends sampled tokens, checks
stop conditions and frees finished requests; it also feeds what the step computed and the
runner's timing of it to the step-cost model, the prediction's error to the step log (metrics),
and the scheduled tokens to fair share.

Calling protocol (one thread, the engine core's): schedule() → the runner executes the
SchedulerOutput → update() with that output, before the next schedule(). add_request()
and abort_requests() go between steps. If the runner raised instead, fail_step() with that
SchedulerOutput takes update()'s place for a step of one request; for a step of several,
requeue_step() puts them back and schedule_alone() runs each by itself until it samples (the
engine core's recovery), so the one to blame fails alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future

from servelm.config import KVTransferConfig, SchedulerConfig, SpeculativeConfig
from servelm.datatypes import (
    CachedRequestData,
    EngineOutput,
    EngineRequest,
    EventType,
    KVTransfers,
    LayerSlice,
    ModelOutput,
    NewRequestData,
    PositionLogprobs,
    SchedulerOutput,
)
from servelm.kv.block_pool import KVCacheEvent, PrefixCacheStats
from servelm.kv.kv_cache_manager import ComputedBlocks, KVCacheManager
from servelm.kv.tiers import KVTiers
from servelm.scheduler.chunk_choice import choose_chunk
from servelm.scheduler.drafts import DraftScheduling, SpecCounters
from servelm.scheduler.grammar_waits import GrammarWaits, sampling_grammars
from servelm.scheduler.ranking import FairShare, Ranking, prefill_order
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.step_cost import StepCostModel, StepShape
from servelm.scheduler.step_log import StepLog
from servelm.scheduler.step_plan import ChunkPlan, StepPlan
from servelm.scheduler.step_pricing import (
    LAYER_SHARE,
    LONE_LAYER_SHARE,
    StepPricing,
    configured_step_target_s,
    executed_shape,
    finishing_slowdown,
    paced_step_target_s,
)
from servelm.scheduler.stop import check_stop
from servelm.scheduler.tier_loads import Admission, TierLoads
from servelm.scheduler.waiting_queue import WaitingQueue
from servelm.structured.grammars import CompiledGrammar, GrammarCompiler, SamplingGrammar

logger = logging.getLogger(__name__)
# The step a deferred prompt is credited at arrival when steps have no time target (_schedule_deferred).
DEFERRED_STEP_S = 0.1


class SchedulerInvariantError(RuntimeError):
    """Request bookkeeping is inconsistent: a bug, never a user error."""


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: Collection[int] = (),
        clock: Callable[[], float] = time.time,  # wall clock for events and aging
        speculative: SpeculativeConfig | None = None,  # None: no request ever verifies drafts
        kv_tiers: KVTiers | None = None,  # KV beyond the pool (host / disk); None: the pool alone
        kv_transfer: KVTransferConfig | None = None,  # disaggregation (needs kv_tiers); None: no role
        num_layers: int = 0,  # the model's decoder layers, for layered prefill (0: token chunks only)
        grammars: GrammarCompiler | None = None,  # structured outputs; None: a request asking for them is refused
        max_loras: int = 0,  # LoRA: distinct adapters running at once (the runner's slots); 0: no LoRA
        # LoRA: whether an adapter's weights are in host memory (lora/registry.py; a False starts
        # their read in the background, and its requests wait for it without holding anyone up).
        adapter_ready: Callable[[str], bool] | None = None,
    ) -> None:
        if scheduler_config.max_model_len is None:
            raise ValueError(
                "SchedulerConfig.max_model_len is unresolved: pass the context window the model and "
                "KV pool allow (EngineConfig.scheduler_for)"
            )
        capacity = kv_cache_manager.num_blocks * kv_cache_manager.block_size
        if capacity < scheduler_config.max_model_len:
            # One request alone could then outgrow the cache and preempt itself forever.
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                f"({scheduler_config.max_model_len}): add blocks or lower max_model_len"
            )
        self.config = scheduler_config
        self.max_loras = max_loras
        self._adapter_ready = adapter_ready
        self.max_model_len: int = scheduler_config.max_model_len
        self._kv = kv_cache_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self._clock = clock
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._running: list[Request] = []
        self._ranking = Ranking(scheduler_config.aging_s)
        self._fair_share = FairShare()  # fed by update(), read by the waiting queue's order
        self._waiting = WaitingQueue(self._ranking, self._fair_share)
        self._finished_ids: set[str] = set()  # the runner must forget these next step
        self._pending_outputs: list[EngineOutput] = []  # aborts, delivered by the next update()
        self._next_arrival_seq = 0
        self.step_cost = StepCostModel()  # calibrated by the builder, refined in update() from the runner's timings
        self._num_layers = num_layers if scheduler_config.layered_prefill else 0
        self.step_log = StepLog()  # what the executed steps were, for metrics
        self._drafts = DraftScheduling(speculative, self.max_model_len) if speculative is not None else None
        self._tier_loads = TierLoads(kv_tiers, kv_cache_manager, kv_transfer) if kv_tiers is not None else None
        self._grammar_waits = GrammarWaits(grammars) if grammars is not None else None

    # -- queries -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_waited_for(self, seconds: float) -> int:
        """Waiting requests that arrived `seconds` or more ago."""
        return self._waiting.num_arrived_before(self._clock() - seconds)

    def has_unfinished_requests(self) -> bool:
        """True while any request is unfinished, an abort's output awaits update(), or KV transfers
        are ordered or in flight (a finished request's last blocks are saved by one more step)."""
        tiers_busy = self._tier_loads is not None and self._tier_loads.has_pending()
        return bool(self._requests) or bool(self._pending_outputs) or tiers_busy

    @property
    def kv_tiers(self) -> KVTiers | None:
        return self._tier_loads.tiers if self._tier_loads is not None else None

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request, for inspection only: never mutate it."""
        return self._requests.get(request_id)

    @property
    def layered_prefill_layers(self) -> int:
        """The model layers a layered chunk is run in (0: token chunks only), as passed at construction
        (a simulated replica builds its scheduler with the same: servelm.simulate)."""
        return self._num_layers

    @property
    def num_prefilling(self) -> int:
        """Running prompts mid-prefill (partial prefills)."""
        return sum(1 for r in self._running if r.is_prefilling)

    @property
    def kv_cache_usage(self) -> float:
        return self._kv.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._kv.stats

    @property
    def spec_counters(self) -> SpecCounters | None:
        """Drafts verified and accepted so far; None without speculative decoding."""
        return self._drafts.counters if self._drafts is not None else None

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Block stored / removed events since the last call (for a router): the pool's (medium
        DEVICE), then the tiers'. Each medium's events keep their order, which is all a mirror of
        per-medium sets needs (a block's presence in one medium never depends on another's)."""
        events = self._kv.take_events()
        tiers = self.kv_tiers
        return events + tiers.take_events() if tiers is not None else events

    # -- requests in and out ------------------------------------------------------

    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request. Raises ValueError for a duplicate id or a prompt that cannot run
        (the API process validates first; this is the backstop)."""
        request_id = engine_request.request_id
        num_prompt = len(engine_request.prompt_token_ids)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running or waiting")
        if not 0 < num_prompt < self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt} tokens: need 1 to {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for one output token)"
            )
        structured = engine_request.sampling_params.structured is not None
        if structured and self._grammar_waits is None:
            raise ValueError("structured outputs are not available on this engine (no grammar backend)")
        if engine_request.sampling_params.structured_resume_tokens >= num_prompt:
            raise ValueError("structured_resume_tokens must be fewer than the prompt's tokens")
        now = self._clock()
        request = Request.from_engine_request(engine_request, self._next_arrival_seq, now)
        self._next_arrival_seq += 1
        if structured and self._grammar_waits is not None:
            self._grammar_waits.submit(request)  # compiles off the step loop; admitted once ready
        request.record(EventType.ARRIVED, now)
        request.record(EventType.QUEUED, now)
        self._requests[request_id] = request
        self._waiting.add(request)
        if self._tier_loads is not None:
            self._tier_loads.arrived(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests now and free their blocks. Unknown or finished ids are ignored
        (safe to repeat). Their ABORT outputs come from the next update(); until then
        has_unfinished_requests() stays True so the engine steps once more."""
        now = self._clock()
        aborted = [self._requests[rid] for rid in dict.fromkeys(request_ids) if rid in self._requests]
        if not aborted:
            return
        self._take_off_lists(aborted)
        for request in aborted:
            self._finish(request, RequestStatus.FINISHED_ABORTED, now)
            self._pending_outputs.append(self._make_output(request, [], None))

    def fail_step(self, scheduler_output: SchedulerOutput, error: str) -> list[EngineOutput]:
        """The runner raised on `scheduler_output`: finish every request it scheduled with an ERROR
        output carrying `error`, free their blocks, and make the runner forget them and this step's
        preempted requests next step (its mirrors may be half-applied). Returns the outputs (pending
        aborts included) in update()'s place; other requests are untouched and run on."""
        now = self._clock()
        failed = self._take_back_step(scheduler_output)
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs.extend(self._finish_with_error(request, error, now) for request in failed)
        return outputs

    def requeue_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The runner raised on a step of several requests: which one is to blame is not known. Put
        every request it scheduled back to waiting (their KV dropped, as in a preemption: they
        recompute) so the engine can retry each alone (`schedule_alone`), and make the runner forget
        them. Returns their ids in schedule order. Nothing is finished here."""
        now = self._clock()
        plan = StepPlan(budget=0)
        requeued = self._take_back_step(scheduler_output)
        for request in requeued:
            self._preempt(request, plan, now)
        self._requeue(plan)
        return [r.request_id for r in requeued]

    def _take_back_step(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The live requests a failed step scheduled, taken off the running and waiting lists, and
        the runner told to forget them and what the step had it forget (it may not have applied
        the step: forgetting is idempotent). The caller finishes or requeues them."""
        taken = [self._requests[rid] for rid in scheduler_output.scheduled_request_ids if rid in self._requests]
        self._take_off_lists(taken)
        self._finished_ids |= scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids
        self._finished_ids |= {r.request_id for r in taken}
        return taken

    def schedule_alone(self, request_id: str) -> SchedulerOutput | None:
        """A step of `request_id` alone, up to its next sample: it is admitted (or continues its
        prefill) with the whole token budget and nothing else runs. None once it has nothing left
        to prove alone (it decodes, finished, or was aborted) or its blocks cannot be had now (it
        then waits and runs with the others)."""
        request = self._requests.get(request_id)
        if request is None or request.status is RequestStatus.LOADING_KV:
            return None  # gone, or waiting for its KV from a tier: it runs with the others once loaded
        if request.status is RequestStatus.RUNNING and request.num_tokens - request.num_computed_tokens <= 1:
            return None  # caught up (it sampled): it decodes with the others from now on
        now = self._clock()
        # Nothing else runs: no cap, and its chunk may leave the prompt unfinished if chunked.
        chunked = self.config.enable_chunked_prefill
        plan = StepPlan(budget=self.config.max_num_batched_tokens, partial_slots=int(chunked), long_slots=1)
        if request.status is RequestStatus.RUNNING:
            num_new = plan.prefill_chunk(request.num_tokens - request.num_computed_tokens)
            new_block_ids = self._kv.allocate_slots(
                request_id, num_new, num_computed_tokens=request.num_computed_tokens
            )
            if new_block_ids is None:
                return None
            self._send_running(request, new_block_ids, plan)
            plan.take(request_id, num_new)
        elif self._try_admit(request, plan, now):
            self._waiting.remove_many([request])
        else:
            return None
        return self._output(plan)

    # -- schedule -------------------------------------------------------------------

    def step_target_s(self) -> float | None:
        """The step-time target before any decode's class tightens it (step_pricing.py); None: none."""
        return configured_step_target_s(self.step_cost, self.config.max_step_ms, self._num_layers)

    def _step_target_s(self, decoding: list[Request], prefilling: list[Request]) -> tuple[float | None, bool]:
        """The step-time target with these requests decoding and these prompts mid-prefill (and the
        waiting ones), and whether the pace bound binds (step_pricing.paced_step_target_s). The pace
        is kept for the decodes whose priority is as good as the best prompt's: a batch stream's
        pace never holds back an interactive prompt."""
        # max_step_ms 0 asks for unbounded steps: no pace bound either (a class's TBT target still binds).
        slowdown = self.config.max_decode_slowdown if self.config.max_step_ms != 0 else 0.0
        best_prompt = min((p for p in (self._waiting.best_priority(), *(r.priority for r in prefilling))
                           if p is not None), default=None)  # fmt: skip
        paced = None
        if slowdown > 0 and best_prompt is not None:
            paced_requests = [r for r in decoding if r.priority <= best_prompt]
            paced = sum((StepShape.decode(1, r.num_computed_tokens) for r in paced_requests), StepShape())
            if paced_requests:
                fewest_left = min(r.tokens_left(self.max_model_len) for r in paced_requests)
                slowdown = finishing_slowdown(self.step_cost, paced, slowdown, fewest_left,
                                              self._prompts_left_s(prefilling))  # fmt: skip
        tbt_targets = (r.slo.tbt_target_s for r in decoding)
        return paced_step_target_s(self.step_cost, self.step_target_s(), tbt_targets, paced, slowdown)

    def _prompts_left_s(self, prefilling: list[Request]) -> Iterator[float]:
        """Predicted prefill time left of each prompt mid-prefill (after its context), then of the
        shortest waiting one (its whole prompt: a prefix hit it may get is not known before it is
        admitted); each as one chunk would take it. Lazy: the waiting queue is walked only if asked."""

        def rests() -> Iterator[tuple[int, int]]:  # (tokens left, context before them)
            for request in prefilling:
                yield request.num_prefill_tokens - request.num_computed_tokens, request.num_computed_tokens
            yield min((r.num_prefill_tokens - r.num_computed_tokens for r in self._waiting), default=0), 0

        for rest, context in rests():
            predicted = self.step_cost.predict(StepShape(dense_passes=1.0) + StepShape.chunk(rest, context)) if rest > 0 else None
            if predicted is not None:
                yield predicted

    def _chunk_cap(self) -> int:
        """The cap on one prompt's chunk before the top-up (long_prefill_token_threshold), while time
        does not price the step: it is what lets a prompt arriving next to a long one into a step
        whose budget the long one would take. A priced step lets the prompts that finish whole go
        first instead (_schedule_prefills), and sizes the long prompt's chunk by the time left."""
        return self.config.prefill_chunk_cap

    def schedule(self) -> SchedulerOutput:
        now = self._clock()
        config = self.config
        if self._grammar_waits:
            for failure in self._grammar_waits.collect(now, is_live=self._requests.__contains__):
                self._take_off_lists([failure.request])
                self._pending_outputs.append(self._finish_with_error(failure.request, failure.error, now))
        decoding = [r for r in self._running if not r.is_prefilling]
        prefilling = [r for r in self._running if r.is_prefilling]
        alone = len(self._running) + len(self._waiting) <= 1  # a lone prompt: the largest layers (step_pricing.py)
        target_s, paced = self._step_target_s(decoding, prefilling)
        pricing = StepPricing(self.step_cost, target_s, self._num_layers, LONE_LAYER_SHARE if alone else LAYER_SHARE,
                              paced=paced)  # fmt: skip
        plan = StepPlan(
            budget=config.max_num_batched_tokens,
            chunk_cap=0 if pricing.priced() else self._chunk_cap(),
            long_threshold=config.prefill_chunk_cap,
            pricing=pricing,
            # Unchunked, no prompt may be left unfinished: a chunk is the whole prompt or nothing.
            partial_slots=config.max_num_partial_prefills if config.enable_chunked_prefill else 0,
            long_slots=config.max_long_partial_prefills,
        )
        if self._tier_loads is not None:
            self._tier_loads.expire(now)
        # Ranked, so preemption victims are the unscheduled requests nearest the end.
        self._running.sort(key=lambda request: self._ranking.rank(request, now))
        self._schedule_decodes(plan, now)
        self._schedule_prefills(plan, now)
        if not pricing.priced():
            self._top_up_prefills(plan)
        self._requeue(plan)
        return self._output(plan)

    @property
    def grammars(self) -> GrammarCompiler | None:
        return self._grammar_waits.compiler if self._grammar_waits is not None else None

    @property
    def num_structured_requests(self) -> int:
        return self._grammar_waits.num_structured_requests if self._grammar_waits is not None else 0

    def compiling_grammars(self) -> list[Future[CompiledGrammar]]:
        """The compiles requests wait for (an idle engine waits on them instead of spinning)."""
        return self._grammar_waits.compiles() if self._grammar_waits is not None else []

    def sampling_grammars(self, scheduler_output: SchedulerOutput) -> list[SamplingGrammar]:
        """The constrained requests that sample in this step: their masks are filled while it runs."""
        return sampling_grammars(self._requests, scheduler_output) if self._grammar_waits is not None else []

    def _output(self, plan: StepPlan) -> SchedulerOutput:
        self._want_drafts_after_prompts(plan)
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            new_requests=plan.new_requests,
            cached_requests=plan.cached_requests,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_request_ids=finished,
            preempted_request_ids={r.request_id for r in plan.preempted},
            scheduled_draft_token_ids=plan.draft_token_ids,
            num_drafts_wanted=plan.num_drafts_wanted,
            kv_transfers=self._tier_loads.take_transfers() if self._tier_loads is not None else KVTransfers(),
            layer_slices=plan.layer_slices,
        )

    def _schedule_decodes(self, plan: StepPlan, now: float) -> None:
        """Step 1: every decode, best rank first, as far as the token budget goes; never cut by time
        (they are the fixed part of the step the prompts' chunks are sized around)."""
        decodes = [r for r in self._running if not r.is_prefilling]
        num_drafts = self._choose_drafts(decodes)
        for request in decodes:
            if plan.budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            # Drafts ride on a caught-up decode only, as far as the budget left after it goes.
            k = min(num_drafts.get(request.request_id, 0), plan.budget - num_new) if num_new == 1 else 0
            new_block_ids = self._allocate_or_preempt(request, num_new + k + self._lookahead(request, k), plan, now)
            if new_block_ids is not None:
                self._send_running(request, new_block_ids, plan)
                plan.take(request.request_id, num_new + k)
                if plan.pricing is not None:
                    plan.pricing.add_decode(num_new + k, request.num_computed_tokens)
                if k:
                    plan.draft_token_ids[request.request_id] = request.draft_token_ids[:k]
                if self._drafts is not None:
                    plan.num_drafts_wanted[request.request_id] = self._drafts.drafts_wanted(request, k)

    def _want_drafts_after_prompts(self, plan: StepPlan) -> None:
        """A prompt its chunk finishes samples its first token this step, and the runner proposes
        after it: as many drafts as the controller could use next step (a draft model's guesses
        cost a forward each; decodes were asked in _schedule_decodes)."""
        if self._drafts is None:
            return
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request_id in plan.num_drafts_wanted or request is None:
                continue
            if request.num_computed_tokens + num_tokens >= request.num_tokens:
                plan.num_drafts_wanted[request_id] = self._drafts.drafts_wanted(request, 0)

    def _lookahead(self, request: Request, num_drafts: int) -> int:
        """Slots past this step's tokens a draft model writes its next guesses into (0 for token-only
        proposers); never past the context window."""
        if self._drafts is None:
            return 0
        room = self.max_model_len - (request.num_computed_tokens + 1 + num_drafts)
        return max(0, min(self._drafts.lookahead_slots, room))

    def _choose_drafts(self, decodes: list[Request]) -> dict[str, int]:
        """k per decode (missing: 0): what each may verify, and what pays at this step's size and cost."""
        if self._drafts is None or not decodes:
            return {}
        return self._drafts.choose(decodes, self.step_cost.decode_cost())

    def _schedule_prefills(self, plan: StepPlan, now: float) -> None:
        """Step 2: running prompts mid-prefill and waiting requests, merged by (effective priority,
        deadline, running first). In a priced step, within one effective priority the prompts that
        finish whole in the time left go first and the others (a long prompt's next chunk or
        layers) after them, so a short request never waits behind a long prompt of its class."""
        prefilling = [r for r in self._running if r.is_prefilling]  # step 1 scheduled none of them
        num_prefilling_left = len(prefilling)
        admitted: list[Request] = []
        deferred: list[tuple[bool, Request]] = []  # (is_waiting, request): after the level's short ones
        level: int | None = None
        pricing = plan.pricing
        for is_waiting, request in prefill_order(prefilling, self._waiting.ordered(now), self._ranking, now):
            if plan.budget <= 0 or (pricing is not None and pricing.time_left_s() <= 0 and plan.has_prefill):
                break
            priority = self._ranking.effective_priority(request, now)
            if deferred and priority != level:  # the level's short prompts are in: its long ones now
                self._schedule_deferred(deferred, plan, now, admitted)
                deferred = []
            level = priority
            if not is_waiting:
                num_prefilling_left -= 1
                if request.status is not RequestStatus.RUNNING:
                    continue  # preempted earlier in this loop
                if self._defers(request, plan):
                    deferred.append((False, request))
                else:
                    self._schedule_prefill_chunk(request, plan, now)
            elif self._admission_open(plan):
                if self._defers(request, plan):
                    deferred.append((True, request))
                elif self._try_admit(request, plan, now):
                    admitted.append(request)
            elif not num_prefilling_left:
                break  # nobody can be admitted: stop before walking a long queue for nothing
        self._schedule_deferred(deferred, plan, now, admitted)
        self._waiting.remove_many(admitted)

    def _defers(self, request: Request, plan: StepPlan) -> bool:
        """In a priced step: does `request` wait for its level's short prompts (its rest does not
        finish whole in the time left, or its chunk runs by layers)?"""
        pricing = plan.pricing
        if pricing is None or not pricing.priced():
            return False
        if request.layered_tokens:
            return True
        rest = request.num_tokens - request.num_computed_tokens
        return rest > plan.budget or not pricing.fits_chunk(rest, request.num_computed_tokens)

    def _schedule_deferred(self, deferred: list[tuple[bool, Request]], plan: StepPlan, now: float,
                           admitted: list[Request]) -> None:  # fmt: skip
        """One level's prompts that do not finish whole this step, by their wait per second of
        prefill left, highest first (highest response ratio next): (time since arrival + one step)
        / the cost model's time for the tokens left at their depth (tokens left, without a fit).
        Fresh, the quickest to finish go first: a 600-token prompt that arrived behind two 4k-token
        prompts of its class finishes in a few steps instead of after them. Waiting, a longer prompt
        catches up in proportion to its work: a 400-token chat prompt is never starved by the
        250-token ones that keep arriving after it (it waits about a step per 250 tokens of
        difference, where shortest-first held it until aging moved it up a level: 10 s, the chat
        workload's TTFT p99 on 2 cores). Time, not tokens, because a long prompt's last tokens are
        its dearest (each attends over all before it): counted in tokens, a 4k-token code prompt
        that had waited 6 s and had 1.5k tokens left at depth 2.5k kept outranking a 394-token voice
        turn that arrived then, its ratio growing as its tokens left shrank, and the turn waited 11 s
        for the whole prompt (the mixed profile, simulated on the 2-core host's profile). Rank order
        among equals (the sort is stable)."""
        pricing = plan.pricing
        step_s = pricing.target_s if pricing is not None and pricing.target_s else DEFERRED_STEP_S

        priced = self.step_cost.coefficients() is not None  # one unit for every prompt of the sort

        def wait_per_work_left(item: tuple[bool, Request]) -> float:
            request = item[1]
            left = max(1, request.num_tokens - request.num_computed_tokens)
            work = max(self.step_cost.prompt_left_s(left, request.num_computed_tokens) or 0.0, 1e-9) if priced else left
            return (max(0.0, now - request.arrival_time) + step_s) / work

        deferred = sorted(deferred, key=wait_per_work_left, reverse=True)
        for is_waiting, request in deferred:
            if plan.budget <= 0 and not request.layered_tokens:
                break
            if not is_waiting:
                if request.status is RequestStatus.RUNNING:  # not preempted since it was deferred
                    self._schedule_prefill_chunk(request, plan, now)
            elif self._admission_open(plan) and self._try_admit(request, plan, now):
                admitted.append(request)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether `request`'s LoRA adapter (if any) fits beside the running requests': at most
        max_loras distinct adapters run at once, so every step's fit the runner's slots."""
        if request.lora_name is None:
            return True
        running = self.running_adapters()
        if request.lora_name not in running and len(running) >= self.max_loras:
            return False
        return self._adapter_ready is None or self._adapter_ready(request.lora_name)

    def running_adapters(self) -> set[str]:
        """The LoRA adapters the running requests use (the runner holds each in a slot)."""
        return {r.lora_name for r in self._running if r.lora_name is not None}

    def adapters_in_use(self) -> set[str]:
        """The LoRA adapters any unfinished request uses, running or waiting."""
        return {r.lora_name for r in self._requests.values() if r.lora_name is not None}

    def fail_adapter_requests(self, name: str, error: str) -> None:
        """Every unfinished request for LoRA adapter `name` fails with `error` (its weights cannot be
        read any more); their outputs go out with the next step's."""
        now = self._clock()
        doomed = [r for r in self._requests.values() if r.lora_name == name]
        self._take_off_lists(doomed)
        self._pending_outputs.extend(self._finish_with_error(r, error, now) for r in doomed)

    def _admission_open(self, plan: StepPlan) -> bool:
        # New tokens always need a fresh block (a prefix hit covers full blocks only).
        num_loading = len(self._tier_loads) if self._tier_loads is not None else 0
        return (
            not plan.preempted
            and len(self._running) + num_loading < self.config.max_num_seqs
            and self._kv.num_free_blocks > 0
        )

    def _plan_chunk(self, request: Request, num_computed: int, plan: StepPlan) -> ChunkPlan | None:
        """`request`'s chunk this step after `num_computed` of its tokens (chunk_choice.py)."""
        return choose_chunk(plan, request.num_tokens - num_computed, num_computed,
                            mid_prefill=request.status is RequestStatus.RUNNING, num_layers=self._num_layers,
                            max_chunk_tokens=self.config.max_num_batched_tokens, block_size=self._kv.block_size)  # fmt: skip

    def _schedule_prefill_chunk(self, request: Request, plan: StepPlan, now: float) -> None:
        if request.layered_tokens:
            self._schedule_layers(request, plan, now)
            return
        num_uncomputed = request.num_tokens - request.num_computed_tokens
        chunk = self._plan_chunk(request, request.num_computed_tokens, plan)
        if chunk is None:
            plan.sat_out.append(request)  # no slot or no time: it keeps its KV; only the top-up may move it
            return
        new_block_ids = self._allocate_or_preempt(request, chunk.num_tokens, plan, now)
        if new_block_ids is not None:
            sent = self._send_running(request, new_block_ids, plan)
            if chunk.num_layers:
                self._begin_layered(request, chunk, plan)
            else:
                self._take_chunk(request, chunk.num_tokens, num_uncomputed, sent.new_block_ids, plan)

    def _take_chunk(self, request: Request, num_tokens: int, num_uncomputed: int, block_ids: list[int],
                    plan: StepPlan) -> None:  # fmt: skip
        """A token chunk of `num_tokens` (all layers) into the step, its time into the pricing."""
        if plan.pricing is not None:
            plan.pricing.add_chunk(num_tokens, request.num_computed_tokens)
        plan.take_prefill(request, num_tokens, num_uncomputed, block_ids)
        if num_tokens == num_uncomputed:
            self._bound_for_first_token(request, plan)

    def _begin_layered(self, request: Request, chunk: ChunkPlan, plan: StepPlan) -> None:
        """A layered chunk begins (its blocks are allocated): its first layers run this step."""
        request.layered_tokens, request.layers_done = chunk.num_tokens, 0
        request.layered_alone = plan.pricing is not None and plan.pricing.layer_share == LONE_LAYER_SHARE
        self._take_layers(request, chunk.num_layers, plan)

    def _schedule_layers(self, request: Request, plan: StepPlan, now: float) -> None:
        """The next layers of `request`'s chunk in flight: as many as fit the time left (the step's
        first prefill work: at least one); none leaves it waiting with its layers so far.

        A chunk sized while its prompt was alone (LONE_LAYER_SHARE: layers up to half the target)
        whose layer no longer fits because streams now decode beside it at their pace bound starts
        over at the size these steps take: its layers so far are lost (at most one chunk's work, only
        when the engine stops being idle), where running on would hold every such stream's token gap
        at one large layer for the rest of the chunk."""
        layers_left = self._num_layers - request.layers_done
        num_uncomputed = request.num_tokens - request.num_computed_tokens
        assert plan.pricing is not None  # schedule() prices every step it plans
        num_layers = plan.pricing.layers_within(request.layered_tokens, request.num_computed_tokens, layers_left)
        if num_layers == 0 and request.layered_alone and plan.pricing.paced:
            request.layered_tokens = request.layers_done = 0
            self._schedule_prefill_chunk(request, plan, now)
            return
        if num_layers == 0 and not plan.has_prefill:
            num_layers = 1
        finishes_prompt = num_layers == layers_left and request.layered_tokens == num_uncomputed
        if num_layers and (finishes_prompt or plan.has_slot(num_uncomputed)):
            self._take_layers(request, num_layers, plan)

    def _take_layers(self, request: Request, num_layers: int, plan: StepPlan) -> None:
        """`num_layers` more layers of `request`'s layered chunk run this step; the last of them
        completes the chunk, whose tokens then count as scheduled (update() computes them)."""
        num_tokens, start = request.layered_tokens, request.layers_done
        end = start + num_layers
        plan.layer_slices[request.request_id] = LayerSlice(num_tokens, start, end)
        if plan.pricing is not None:
            plan.pricing.add_slice(num_tokens, request.num_computed_tokens, num_layers)
        num_uncomputed = request.num_tokens - request.num_computed_tokens
        if end < self._num_layers:
            plan.take_slot(num_uncomputed)  # the prompt stays unfinished this step
            return
        plan.take_completed_chunk(request.request_id, num_tokens)
        if num_tokens < num_uncomputed:
            plan.take_slot(num_uncomputed)
        else:
            self._bound_for_first_token(request, plan)

    def _bound_for_first_token(self, request: Request, plan: StepPlan) -> None:
        """`request`'s prompt completes in this step: its first token is due at the step's end, a
        gap like a decode's. What the step may still take (lower-ranked chunks) is bounded
        (StepPricing.bound_for_first_token: a share of the target, and the prompt's class TBT), so a
        request does not wait for others' bulk prefill in its own step. Its own chunk is already in."""
        if plan.pricing is not None:
            plan.pricing.bound_for_first_token(request.slo.tbt_target_s)

    def _top_up_prefills(self, plan: StepPlan) -> None:
        """Step 3, unpriced steps only: budget nobody else could use, to the chunks that left their
        prompt unfinished, then to the running prompts that sat the step out, in schedule order, as
        far as blocks go. (A priced step sized every chunk by the time left already.)"""
        for request, block_ids in plan.unfinished_prefills:
            more = self._grow_chunk(request, plan)
            if more is not None:
                block_ids.extend(more)
        for request in plan.sat_out:
            if request.status is not RequestStatus.RUNNING:
                continue  # a later chunk preempted it
            more = self._grow_chunk(request, plan)
            if more is not None:
                self._send_running(request, more, plan)

    def _grow_chunk(self, request: Request, plan: StepPlan) -> list[int] | None:
        """Add to `request`'s chunk this step what the budget left and the free blocks allow.
        Returns the blocks that took, or None when it cannot grow."""
        num_scheduled = plan.num_scheduled_tokens.get(request.request_id, 0)
        room = self._kv.max_new_tokens(request.request_id, num_computed_tokens=request.num_computed_tokens)
        num_total = min(request.num_tokens - request.num_computed_tokens, num_scheduled + plan.budget, room)
        if num_total <= num_scheduled:
            return None
        more = self._kv.allocate_slots(request.request_id, num_total, num_computed_tokens=request.num_computed_tokens)
        if more is None:
            raise SchedulerInvariantError(f"{request.request_id!r}: {num_total} tokens fit but could not be allocated")
        plan.take(request.request_id, num_total - num_scheduled)
        return more

    def _send_running(self, request: Request, new_block_ids: list[int], plan: StepPlan) -> CachedRequestData:
        """Tell the runner what a running request gained since it last saw it."""
        sent = CachedRequestData(
            request_id=request.request_id,
            new_token_ids=request.all_token_ids[request.num_sent_tokens :],
            new_block_ids=new_block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )
        plan.cached_requests.append(sent)
        request.num_sent_tokens = request.num_tokens
        return sent

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan, now: float) -> list[int] | None:
        """Blocks for `num_new` more tokens of a running request, preempting the worst-ranked
        running requests not yet scheduled this step (perhaps itself: then None)."""
        while True:
            new_block_ids = self._kv.allocate_slots(
                request.request_id, num_new, num_computed_tokens=request.num_computed_tokens
            )
            if new_block_ids is not None:
                return new_block_ids
            # `request` itself is unscheduled, so there is always a victim.
            victim = next(
                r for r in reversed(self._running)
                if r.request_id not in plan.num_scheduled_tokens and r.request_id not in plan.layer_slices
            )
            self._running.remove(victim)
            self._preempt(victim, plan, now)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: StepPlan, now: float) -> None:
        """Drop its KV; it recomputes prompt + output later (it keeps its output tokens). The
        caller takes it off the running list; _requeue puts it back to waiting."""
        self._kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.tiers_looked_up = False  # its saved blocks may swap back in
        request.num_preemptions += 1
        request.num_sent_tokens = 0  # the runner drops its mirror; it is re-sent in full
        request.layered_tokens = request.layers_done = 0  # the runner drops its chunk in flight too
        self._drop_drafts(request)
        request.record(EventType.PREEMPTED, now)
        request.record(EventType.QUEUED, now)
        plan.preempted.append(request)

    def _drop_drafts(self, request: Request) -> None:
        request.draft_token_ids = []
        if self._drafts is not None:
            self._drafts.forget(request.request_id)

    def _take_off_lists(self, requests: list[Request]) -> None:
        """Remove live requests from the running list, the waiting queue or the loading ones,
        whichever holds each."""
        for request in requests:
            if request.status is RequestStatus.LOADING_KV and self._tier_loads is not None:
                self._tier_loads.abort(request)
        self._waiting.remove_many(r for r in requests if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED))
        gone = {id(r) for r in requests}
        self._running = [r for r in self._running if id(r) not in gone]

    def _requeue(self, plan: StepPlan) -> None:
        # After the step is planned: the waiting queue must not change while step 2 walks it.
        for request in plan.preempted:
            self._waiting.add(request)

    def _is_starving(self, request: Request, now: float) -> bool:
        # A class that does not age (batch) waits for interactive traffic by design: never starving.
        return self.config.aging_s > 0 and request.slo.ages and now - request.arrival_time >= self.config.aging_s

    def _try_admit(self, request: Request, plan: StepPlan, now: float) -> bool:
        if request.grammar_compile is not None:
            return False  # its grammar is still compiling: others go meanwhile
        if not self._adapter_fits(request):
            return False  # every adapter slot is taken by running requests, or its adapter is being read: it waits, others go
        hit = self._lookup(request)
        if self._tier_loads is not None:
            admission = self._tier_loads.try_start(request, hit, self.step_cost, now)
            if admission is not Admission.COMPUTE:
                # LOADING: it waits for its KV off the queue (tier_loads.py), taking no budget;
                # DEFER: it stays in the queue, its pull waiting for room.
                return admission is Admission.LOADING
        num_uncomputed = request.num_tokens - hit.num_computed_tokens
        chunk = self._plan_chunk(request, hit.num_computed_tokens, plan)
        num_new = chunk.num_tokens if chunk is not None else 0
        room = self._kv.max_new_tokens(
            request.request_id, num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit
        )
        if num_new > room and self._is_starving(request, now) and plan.has_slot(num_uncomputed):
            num_new = room  # the aging guarantee: it starts in what is free instead of waiting for more
            chunk = ChunkPlan(num_new)  # a token chunk: a layered one needs its whole chunk's blocks
        if chunk is None or not 0 < num_new <= room:
            return False
        block_ids = self._kv.allocate_slots(
            request.request_id, num_new, num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit
        )
        if block_ids is None:
            raise SchedulerInvariantError(f"{request.request_id!r}: {num_new} tokens fit but could not be allocated")
        if self._tier_loads is not None:
            self._tier_loads.admitted_without_load(request, hit)
            self._tier_loads.admitted(request, hit)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_computed_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_computed_tokens
        request.num_prefill_tokens = request.num_tokens
        request.record(EventType.SCHEDULED, now)
        self._running.append(request)
        plan.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,  # never mutated: shared, not copied
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                lora_name=request.lora_name,
            )
        )
        request.num_sent_tokens = request.num_tokens
        if chunk.num_layers:
            self._begin_layered(request, chunk, plan)
        else:
            self._take_chunk(request, num_new, num_uncomputed, block_ids, plan)
        return True

    def _lookup(self, request: Request) -> ComputedBlocks:
        # Cached positions yield no logits: a request still owed prompt logprobs computes
        # its whole prompt (its blocks are still cached, in its own namespace).
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            return ComputedBlocks.miss(request.extra_key)
        return self._kv.get_computed_blocks(request.request_id, request.all_token_ids, request.extra_key)

    # -- update ---------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> list[EngineOutput]:
        """Apply one executed step. Returns one output per request that got tokens or finished."""
        now = self._clock()
        # The fit is of the target's step; the proposer's time is charged to drafts (drafts.py).
        forward_seconds = model_output.execute_seconds - model_output.propose_seconds
        shape, kind = self.executed_shape(scheduler_output)
        predicted = self.step_cost.predict(shape)  # what the step was planned against
        self.step_cost.observe(shape, forward_seconds)
        self.step_log.record_prediction(kind, predicted, forward_seconds)
        self._advance_layers(scheduler_output)
        if self._drafts is not None:
            num_drafts_made = sum(len(drafts) for drafts in model_output.draft_token_ids.values())
            self._drafts.proposed(model_output.propose_seconds, num_drafts_made)
        self.step_log.record(scheduler_output, model_output)
        if scheduler_output.has_work:
            self.step_log.record_shape(shape, forward_seconds, len(scheduler_output.num_scheduled_tokens))
        self._fair_share.decay(now)
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._tier_loads is not None:
            self._tier_loads.record_saved(model_output.kv_saved_bytes)
            self._tier_loads.exports_served(model_output.kv_exports_served)
            for arrived in self._tier_loads.finish(model_output.kv_load_results, now):
                arrived.record(EventType.QUEUED, now)
                self._waiting.add(arrived)
        any_finished = False
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted after schedule(): its output is already out
            drafts = scheduler_output.scheduled_draft_token_ids.get(request_id, [])
            output = self._update_request(request, num_scheduled, drafts, model_output, now)
            if output is not None:
                outputs.append(output)
            any_finished |= request.status.is_finished
        if any_finished:
            self._running = [r for r in self._running if not r.status.is_finished]
        return outputs

    def executed_shape(self, scheduler_output: SchedulerOutput) -> tuple[StepShape, str]:
        """What a step computed and its kind (step_pricing.executed_shape), before update() advances it."""
        return executed_shape(scheduler_output, self._requests, self.step_cost, self._num_layers)

    def _advance_layers(self, scheduler_output: SchedulerOutput) -> None:
        """The layers a step ran of each layered chunk; a chunk whose last layer ran is done (its
        tokens are computed with the step's other chunks in _update_request)."""
        for request_id, layers in scheduler_output.layer_slices.items():
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING or not request.layered_tokens:
                continue  # aborted or preempted after schedule(): its chunk is gone with its KV
            request.layers_done = layers.end_layer
            if layers.end_layer >= self._num_layers:
                request.layered_tokens = request.layers_done = 0

    def _update_request(
        self,
        request: Request,
        num_scheduled: int,
        drafts: list[int],  # the drafts this step verified for it (1 + len(drafts) of num_scheduled)
        model_output: ModelOutput,
        now: float,
    ) -> EngineOutput | None:
        request_id = request.request_id
        computed_before = request.num_computed_tokens
        sampled = model_output.sampled_token_ids.get(request_id, [])
        caught_up = computed_before + num_scheduled >= request.num_tokens
        if caught_up and not sampled:
            # It would have nothing left to compute and never finish: fail loudly instead.
            raise ValueError(f"ModelOutput has no sampled token for {request_id!r}, whose step reached its last token")
        num_accepted = self._accepted_drafts(request, drafts, sampled, now)
        # Only accepted positions hold valid KV: the rejected drafts' slots are overwritten later.
        request.num_computed_tokens += num_scheduled - (len(drafts) - num_accepted)
        self._fair_share.add(request.slo, num_scheduled)
        # The accepted drafts are the tokens at the newly computed positions (appended below).
        token_ids = request.all_token_ids + drafts[:num_accepted] if num_accepted else request.all_token_ids
        cached = self._kv.cache_full_blocks(request_id, token_ids, request.num_computed_tokens, request.slo.tenant)
        if self._tier_loads is not None:
            self._tier_loads.stored(cached, request.slo.kv_retention)
        if computed_before < request.num_prefill_tokens:
            request.record(EventType.PREFILL_CHUNK, now, detail=num_scheduled)
        chunk_logprobs = model_output.prompt_logprobs.get(request_id)
        if chunk_logprobs:
            request.add_prompt_logprobs(chunk_logprobs, chunk_start=computed_before)
        new_token_ids: list[int] = []
        if caught_up:  # the step's last logits gave new token(s); mid-prompt samples are ignored
            new_token_ids = self._append_sampled(request, sampled, now)
            if not request.status.is_finished:
                drafts = model_output.draft_token_ids.get(request_id, [])
                if request.grammar is not None and drafts:  # cut at the first token its grammar refuses
                    drafts = drafts[: request.grammar.num_acceptable(drafts)]
                request.draft_token_ids = drafts
        if not new_token_ids and not request.status.is_finished:
            return None
        logprobs = model_output.logprobs.get(request_id)
        return self._make_output(request, new_token_ids, logprobs[: len(new_token_ids)] if logprobs else None)

    def _accepted_drafts(self, request: Request, drafts: list[int], sampled: list[int], now: float) -> int:
        """How many of the step's `drafts` the runner accepted (it emits them, then one token of its
        own); recorded for metrics, the controller and the request's timeline."""
        if not drafts:
            return 0
        num_accepted = len(sampled) - 1
        if not 0 <= num_accepted <= len(drafts) or sampled[:num_accepted] != drafts[:num_accepted]:
            raise ValueError(
                f"{request.request_id!r}: the runner returned {sampled} for drafts {drafts}: want the accepted "
                "drafts then one token"
            )
        assert self._drafts is not None  # drafts are scheduled only with speculative decoding on
        self._drafts.verified(request, len(drafts), num_accepted)
        request.record(EventType.SPEC_VERIFIED, now, detail=num_accepted)
        return num_accepted

    def _append_sampled(self, request: Request, sampled: list[int], now: float) -> list[int]:
        """Append tokens one by one; tokens after a stop are dropped (several come with speculation)."""
        accepted: list[int] = []
        for token_id in sampled:
            request.append_output_token(token_id)
            accepted.append(token_id)
            if request.num_output_tokens == 1:
                request.record(EventType.FIRST_TOKEN, now)
            grammar = request.grammar
            if grammar is not None and not grammar.accept(token_id):
                # The sampler held the token to the grammar's mask: this is a bug, said loudly.
                logger.error("request %s: token %d refused by its grammar after masking", request.request_id, token_id)
                self._finish(request, RequestStatus.FINISHED_ERROR, now)
                break
            stop = check_stop(request, self.eos_token_ids, self.max_model_len)
            if stop is None and grammar is not None and grammar.is_terminated():
                stop = (RequestStatus.FINISHED_STOPPED, None)  # the grammar is complete: nothing may follow
            if stop is not None:
                request.stop_reason = stop[1]
                self._finish(request, stop[0], now)
                break
        return accepted

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        """Free its blocks and forget it. The caller takes it off the running/waiting lists."""
        self._kv.free(request.request_id)
        request.status = status
        self._drop_drafts(request)
        if self._tier_loads is not None:
            self._tier_loads.finished(request, now)
        request.record(EventType.FINISHED, now)
        if request.num_sent_tokens > 0:  # the runner mirrors it
            self._finished_ids.add(request.request_id)
        del self._requests[request.request_id]

    def _finish_with_error(self, request: Request, error: str, now: float) -> EngineOutput:
        """Finish a request that cannot go on; its last output carries `error` for the client."""
        self._finish(request, RequestStatus.FINISHED_ERROR, now)
        output = self._make_output(request, [], None)
        output.error = error
        return output

    def _make_output(
        self, request: Request, new_token_ids: list[int], logprobs: list[PositionLogprobs] | None
    ) -> EngineOutput:
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            prompt_logprobs=request.take_prompt_logprobs(),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            events=request.take_events(),
        )

    # -- checks ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """KV invariants, plus: every unfinished request is running xor waiting, running ones
        hold blocks covering their computed tokens, waiting ones hold none."""
        self._kv.check_invariants()
        running, waiting = self._running, list(self._waiting)
        loading = list(self._tier_loads.loading) if self._tier_loads is not None else []
        ids = [r.request_id for r in running] + [r.request_id for r in waiting] + loading
        if len(ids) != len(set(ids)) or set(ids) != set(self._requests):
            raise SchedulerInvariantError(
                f"running + waiting + loading {sorted(ids)} != unfinished {sorted(self._requests)}"
            )
        if self._tier_loads is not None:
            self._tier_loads.check_invariants()
        if len(running) > self.config.max_num_seqs:
            raise SchedulerInvariantError(f"{len(running)} running > max_num_seqs {self.config.max_num_seqs}")
        for request in running:
            num_slots = len(self._kv.get_block_ids(request.request_id)) * self._kv.block_size
            if request.status is not RequestStatus.RUNNING or num_slots < request.num_computed_tokens:
                raise SchedulerInvariantError(f"running {request.request_id!r}: {request.status}, {num_slots} slots")
            if request.num_computed_tokens > request.num_tokens:
                raise SchedulerInvariantError(f"running {request.request_id!r} computed past its tokens")
        for request in waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise SchedulerInvariantError(f"waiting {request.request_id!r} has status {request.status}")
            if request.num_computed_tokens or self._kv.get_block_ids(request.request_id):
                raise SchedulerInvariantError(f"waiting {request.request_id!r} holds KV")
