"""One step's plan while the Scheduler builds it: budget, prefill slots, time, the runner's diffs.

The token arithmetic of step 2 (scheduler.py) lives here: a long prompt's prefill chunk is
capped at chunk_cap (only while time does not price the step), then by the budget; a chunk that
leaves its prompt unfinished takes a partial slot, and a long one (more than long_threshold tokens
left) a long slot too. The time side is `pricing` (step_pricing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.datatypes import CachedRequestData, LayerSlice, NewRequestData
from servelm.scheduler.request import Request
from servelm.scheduler.step_pricing import StepPricing


@dataclass(frozen=True)
class ChunkPlan:
    """One prompt's chunk this step, as step 2 chose it."""

    num_tokens: int  # tokens of the chunk (all computed this step unless layered)
    num_layers: int = 0  # layered: the model layers of it that run this step; 0: all (a token chunk)


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
    # The step's time: its target and what it holds so far (step_pricing.py). Unpriced (no
    # target or no cost fit), it never binds and the token budget alone does.
    pricing: StepPricing | None = None
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)  # requeued once the step is planned
    # Chunks that leave their prompt unfinished, with the block list the runner is sent: the
    # top-up extends both.
    unfinished_prefills: list[tuple[Request, list[int]]] = field(default_factory=list)
    sat_out: list[Request] = field(default_factory=list)  # running prompts left without a slot
    num_prefill_tokens: int = 0  # prompt tokens of token chunks taken so far
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts verified this step
    num_drafts_wanted: dict[str, int] = field(default_factory=dict)  # drafts worth proposing after it
    layer_slices: dict[str, LayerSlice] = field(default_factory=dict)  # layered chunks' layers this step

    @property
    def has_prefill(self) -> bool:
        """Any prompt work in the step yet: a chunk or a layer slice."""
        return bool(self.unfinished_prefills or self.layer_slices or self.num_prefill_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled so far this step."""
        return sum(self.num_scheduled_tokens.values())

    def take_completed_chunk(self, request_id: str, num_tokens: int) -> None:
        """A layered chunk's last layers run this step: its tokens are computed with the step's, but in
        a forward of their own (worker/layered_chunks.py), so they take none of the token budget
        (which bounds one forward's rows; the chunk was held to it when it began)."""
        self.num_scheduled_tokens[request_id] = num_tokens
        self.num_prefill_tokens += num_tokens

    def take(self, request_id: str, num_tokens: int) -> None:
        self.num_scheduled_tokens[request_id] = self.num_scheduled_tokens.get(request_id, 0) + num_tokens
        self.budget -= num_tokens

    def is_long(self, num_uncomputed: int) -> bool:
        return 0 < (self.long_threshold or self.chunk_cap) < num_uncomputed

    def has_slot(self, num_uncomputed: int) -> bool:
        """May a chunk leave a prompt with `num_uncomputed` tokens left unfinished this step?"""
        return self.partial_slots > 0 and (not self.is_long(num_uncomputed) or self.long_slots > 0)

    def prefill_chunk(self, num_uncomputed: int, mid_prefill: bool = False) -> int:
        """A prompt's chunk before the top-up: capped if the prompt is long or, `mid_prefill` (it
        ran a chunk before), its rest is over the budget; then by the budget; 0 when it would stay
        unfinished and no slot for that is left. A short prompt that fits is not capped (vLLM's
        long_prefill_token_threshold): a burst of short ones goes first come, first served, each
        with the whole budget, where capping them too shared the budget out and gave the first of
        the burst its first token as late as the last's."""
        # A prompt mid-prefill whose rest does not fit the budget is left unfinished either way:
        # capped too, so that a prompt behind it can finish in this step (the top-up returns what
        # nobody takes).
        capped = self.is_long(num_uncomputed) or (mid_prefill and num_uncomputed > self.budget)
        cap = self.chunk_cap if capped and self.chunk_cap else num_uncomputed
        chunk = min(num_uncomputed, self.budget, cap)
        return chunk if chunk == num_uncomputed or self.has_slot(num_uncomputed) else 0

    def take_prefill(self, request: Request, num_tokens: int, num_uncomputed: int, block_ids: list[int]) -> None:
        self.take(request.request_id, num_tokens)
        self.num_prefill_tokens += num_tokens
        if num_tokens < num_uncomputed:
            self.take_slot(num_uncomputed)
            self.unfinished_prefills.append((request, block_ids))

    def take_slot(self, num_uncomputed: int) -> None:
        """A chunk (of tokens or of layers) leaves a prompt with `num_uncomputed` tokens unfinished."""
        self.partial_slots -= 1
        if self.is_long(num_uncomputed):
            self.long_slots -= 1
