"""The scheduler's view of one request. Only the Scheduler mutates it.

Token catch-up: `all_token_ids` grows as tokens are sampled; `num_computed_tokens`
counts those whose KV is in the cache. Each step schedules some of the difference.

    all_token_ids   p0 p1 p2 p3 p4 | o0 o1
                    ├── computed ──┤          num_computed_tokens = 5
                    ├──────── num_tokens ─────┤  = 7: two tokens to catch up
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from servelm.datatypes import (
    DEFAULT_SLO,
    EngineRequest,
    EventType,
    FinishReason,
    KVTransferParams,
    PositionLogprobs,
    RequestEvent,
    RequestSlo,
)
from servelm.kv.block_hash import extra_key_of
from servelm.sampling_params import SamplingParams
from servelm.structured.grammars import CompiledGrammar, GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds blocks; scheduled in some steps
    PREEMPTED = "preempted"  # lost its blocks; waiting to recompute prompt + output
    LOADING_KV = "loading_kv"  # holds blocks a KV tier is filling; then waits again (tier_loads.py)
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # its step failed in the runner (EngineCore.step)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int  # lower runs first
    arrival_time: float  # wall clock; orders requests of one priority and drives aging
    arrival_seq: int  # add_request order: breaks ties between equal arrival times
    cache_salt: str | None = None
    lora_name: str | None = None  # its LoRA adapter: a slot while it runs, and its own prefix cache
    # Tenant and class targets: the deadline order, fair share and step-time target (ranking.py).
    slo: RequestSlo = DEFAULT_SLO
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output as one list, so hashing blocks and slicing diffs need no concatenation
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit on the FIRST schedule (None: not yet)
    num_preemptions: int = 0
    # Scheduler ↔ runner bookkeeping. Tokens of all_token_ids the runner has been sent
    # (0: the runner does not mirror this request, it must get NewRequestData).
    num_sent_tokens: int = 0
    # num_tokens when last (re)admitted: a step starting below it is a prefill chunk.
    num_prefill_tokens: int = 0
    stop_reason: int | None = None  # the stop token id that finished it
    events: list[RequestEvent] = field(default_factory=list)  # since the last EngineOutput
    # Prompt logprobs collected chunk by chunk, delivered with the first output.
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Speculative decoding: tokens the runner's proposer guessed follow all_token_ids, for the
    # next step to verify (scheduler/drafts.py chooses how many). Replaced after every step.
    draft_token_ids: list[int] = field(default_factory=list)
    # KV tiers: its prefix was looked up beyond the pool in this admission (and loaded, if found);
    # its next admission uses the pool alone. Reset by a preemption.
    tiers_looked_up: bool = False
    # Disaggregation: its side of a prefill/decode hand-off (None: an ordinary request), and
    # whether a consumer already pulled (once: after a preemption it swaps in from the tiers or
    # recomputes; the producer's hold is gone by then).
    kv_transfer: KVTransferParams | None = None
    pull_tried: bool = False
    # Layered prefill: the chunk whose forward runs over several steps by layers (its tokens after
    # num_computed_tokens; 0: none in flight) and how many of the model's layers have run. Its
    # blocks are allocated when it begins; its tokens count as computed after its last layer.
    layered_tokens: int = 0
    layers_done: int = 0
    # Its chunk was sized for a prompt alone on the engine (the largest layers); set when a chunk
    # begins, read only while one is in flight (layered_tokens > 0).
    layered_alone: bool = False
    # Structured outputs: its grammar's compile while it waits (None: free text, or compiled),
    # then its matcher, advanced by every token appended (the sampler masked the step by it).
    grammar_compile: Future[CompiledGrammar] | None = None
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @classmethod
    def from_engine_request(cls, request: EngineRequest, arrival_seq: int, now: float) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            priority=request.priority,
            # 0.0 is EngineRequest's "unset": the core's own clock then stands in.
            arrival_time=request.arrival_time if request.arrival_time > 0 else now,
            arrival_seq=arrival_seq,
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            slo=request.slo,
            kv_transfer=request.kv_transfer,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def tokens_left(self, max_model_len: int) -> int:
        """The most output tokens it may still produce: to its max_tokens or the context window,
        whichever comes first (a stop token may end it sooner)."""
        left = max_model_len - self.num_tokens
        max_tokens = self.sampling_params.max_tokens
        return left if max_tokens is None else min(left, max_tokens - self.num_output_tokens)

    @property
    def is_prefilling(self) -> bool:
        """Running with part of what it was admitted with still to compute (a prompt mid-prefill)."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def extra_key(self) -> bytes | None:
        """Its prefix-cache namespace: the tenant's salt and its adapter (KV under one adapter is not
        another's, nor the base model's)."""
        return extra_key_of(self.cache_salt, self.lora_name)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def add_prompt_logprobs(self, chunk: list[PositionLogprobs | None], chunk_start: int) -> None:
        """Collect one prefill chunk's prompt logprobs (see worker/prompt_logprobs.py).

        A chunk from position s carries entries for prompt tokens s+1.. (plus position 0's
        None when s == 0). After a preemption the prompt is recomputed from 0: keep only
        entries past those already collected.
        """
        if self.prompt_logprobs_sent:
            return
        first_index = 0 if chunk_start == 0 else chunk_start + 1
        skip = max(0, len(self.prompt_logprobs) - first_index)
        self.prompt_logprobs.extend(chunk[skip:])

    def take_prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        """Everything collected, once (with the first output); None before and after."""
        if not self.prompt_logprobs or self.prompt_logprobs_sent:
            return None
        collected, self.prompt_logprobs = self.prompt_logprobs, []
        self.prompt_logprobs_sent = True
        return collected

    def record(self, event_type: EventType, now: float, detail: int = 0) -> None:
        self.events.append(RequestEvent(event_type, now, detail))

    def take_events(self) -> list[RequestEvent]:
        events, self.events = self.events, []
        return events
