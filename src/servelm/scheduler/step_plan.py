"""One step's plan while the Scheduler builds it: budget, prefill slots, the runner's diffs.

The slot arithmetic of step 2 (scheduler.py) lives here: a long prompt's prefill chunk is
capped at chunk_cap, then by the budget (and, for a request the arrival bound does not protect, by
what bulk_limit leaves); a chunk that leaves its prompt unfinished takes a partial slot, and
a long one (more than long_threshold tokens left) a long slot too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.datatypes import CachedRequestData, NewRequestData
from servelm.scheduler.request import Request


@dataclass
class StepPlan:
    """What one schedule() call has decided so far: the budget left, the slots for prompts left
    unfinished, and what goes to the runner. Built and mutated by the Scheduler only."""

    budget: int  # tokens left this step
    chunk_cap: int = 0  # most tokens a prefill chunk takes before the top-up (0: no cap)
    partial_slots: int = 0  # chunks this step may still leave their prompt unfinished with
    long_slots: int = 0  # ... of them for prompts with more than long_threshold tokens left
    # What makes a prompt long (long_prefill_token_threshold): the static cap, even when this
    # step's chunk_cap is smaller (a shrunken budget's share); 0: as chunk_cap.
    long_threshold: int = 0
    # The arrival bound (SchedulerConfig.arrival_wait_ms): most tokens the whole step may carry for
    # chunks of requests it does not protect; a protected request's own chunk is held to the budget
    # alone. None: no such bound.
    bulk_limit: int | None = None
    # The step-time target while requests decode (step_cost.step_time_target_s), None without
    # one: the budget is that target in tokens priced at the deepest prompt mid-prefill; a
    # prompt that finishes in the step may go past it when the step still ends in time
    # (Scheduler._prefill_chunk).
    time_target_s: float | None = None
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)  # requeued once the step is planned
    # Chunks that leave their prompt unfinished, with the block list the runner is sent: the
    # top-up extends both.
    unfinished_prefills: list[tuple[Request, list[int]]] = field(default_factory=list)
    sat_out: list[Request] = field(default_factory=list)  # running prompts left without a slot
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts verified this step
    num_drafts_wanted: dict[str, int] = field(default_factory=dict)  # drafts worth proposing after it

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled so far this step."""
        return sum(self.num_scheduled_tokens.values())

    def take(self, request_id: str, num_tokens: int) -> None:
        self.num_scheduled_tokens[request_id] = self.num_scheduled_tokens.get(request_id, 0) + num_tokens
        self.budget -= num_tokens

    def is_long(self, num_uncomputed: int) -> bool:
        return 0 < (self.long_threshold or self.chunk_cap) < num_uncomputed

    def has_slot(self, num_uncomputed: int) -> bool:
        """May a chunk leave a prompt with `num_uncomputed` tokens left unfinished this step?"""
        return self.partial_slots > 0 and (not self.is_long(num_uncomputed) or self.long_slots > 0)

    def room(self, protected: bool = False) -> int:
        """Tokens a chunk may still take: the budget left, and for a request the arrival bound
        does not protect, no more than bulk_limit leaves of the step."""
        if protected or self.bulk_limit is None:
            return self.budget
        return max(0, min(self.budget, self.bulk_limit - self.num_tokens))

    def prefill_chunk(self, num_uncomputed: int, protected: bool = False, mid_prefill: bool = False) -> int:
        """A prompt's chunk before the top-up: capped if the prompt is long or, `mid_prefill` (it
        ran a chunk before), its rest is over the room; then by its room; 0 when it would stay
        unfinished and no slot for that is left. A short prompt that fits is not capped (vLLM's
        long_prefill_token_threshold): a burst of short ones goes first come, first served, each
        with the whole budget, where capping them too shared the budget out and gave the first of
        the burst its first token as late as the last's."""
        room = self.room(protected)
        # A prompt mid-prefill whose rest does not fit the room is left unfinished either way:
        # capped too, so that a prompt behind it can finish in this step (the top-up returns what
        # nobody takes). Its rest may be under long_threshold: the tail of a long prompt under a
        # budget the step-time target shrank to ~100 tokens took every step for ~1 s while an
        # 83-token prompt waited (2 CPU cores, the default model).
        capped = self.is_long(num_uncomputed) or (mid_prefill and num_uncomputed > room)
        cap = self.chunk_cap if capped and self.chunk_cap else num_uncomputed
        chunk = min(num_uncomputed, room, cap)
        return chunk if chunk == num_uncomputed or self.has_slot(num_uncomputed) else 0

    def take_prefill(self, request: Request, num_tokens: int, num_uncomputed: int, block_ids: list[int]) -> None:
        self.take(request.request_id, num_tokens)
        if num_tokens < num_uncomputed:
            self.partial_slots -= 1
            if self.is_long(num_uncomputed):
                self.long_slots -= 1
            self.unfinished_prefills.append((request, block_ids))
