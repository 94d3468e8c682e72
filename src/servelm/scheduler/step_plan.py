"""One step's plan while the Scheduler builds it: budget, prefill slots, the runner's diffs.

The slot arithmetic of step 2 (scheduler.py) lives here: a prefill chunk is capped at
chunk_cap, then by the budget; a chunk that leaves its prompt unfinished takes a partial
slot, and a long one (more than chunk_cap tokens left) a long slot too.
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
    long_slots: int = 0  # ... of them for prompts with more than chunk_cap tokens left
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

    def _is_long(self, num_uncomputed: int) -> bool:
        return 0 < self.chunk_cap < num_uncomputed

    def has_slot(self, num_uncomputed: int) -> bool:
        """May a chunk leave a prompt with `num_uncomputed` tokens left unfinished this step?"""
        return self.partial_slots > 0 and (not self._is_long(num_uncomputed) or self.long_slots > 0)

    def prefill_chunk(self, num_uncomputed: int) -> int:
        """A prompt's chunk before the top-up: capped, then by the budget; 0 when it would stay
        unfinished and no slot for that is left."""
        chunk = min(num_uncomputed, self.budget, self.chunk_cap or num_uncomputed)
        return chunk if chunk == num_uncomputed or self.has_slot(num_uncomputed) else 0

    def take_prefill(self, request: Request, num_tokens: int, num_uncomputed: int, block_ids: list[int]) -> None:
        self.take(request.request_id, num_tokens)
        if num_tokens < num_uncomputed:
            self.partial_slots -= 1
            if self._is_long(num_uncomputed):
                self.long_slots -= 1
            self.unfinished_prefills.append((request, block_ids))
