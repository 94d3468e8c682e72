"""Which drafts a step verifies: k per decoding request, and the counters of what was accepted.

The runner's proposer leaves draft tokens on a request after each step it sampled in
(`Request.draft_token_ids`). When the request next decodes, the scheduler asks this module how
many of them to verify: at most what the request may still use (its max_tokens, the context
window, its own `num_speculative_tokens` override, the configured k), and — with the goodput
controller (`SpeculativeConfig.adaptive`) — what pays at this step's batch and cost. The
request is then scheduled with 1 + k tokens. After the step, `verified` records how many were
accepted (metrics, and the controller's acceptance estimate), and `proposed` what making the
drafts cost (the controller charges it: a draft model's forwards are not free).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from servelm.config import SpeculativeConfig
from servelm.scheduler.request import Request
from servelm.spec.controller import DraftOffer, SpecController, StepCost


@dataclass
class SpecCounters:
    """Cumulative, since the engine started (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # verifications: requests × steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts at position j accepted


# Memory of the proposer's cost per draft, per step that proposed: ~the last 20 such steps, so it
# follows the batch (a draft model's forward is shared by the requests drafting in it).
PROPOSE_COST_MEMORY = 0.95


@dataclass
class ProposeCost:
    """Discounted seconds and drafts of the proposer's recent calls: seconds per draft made."""

    seconds: float = 0.0
    num_drafts: float = 0.0

    def add(self, seconds: float, num_drafts: int) -> None:
        self.seconds = PROPOSE_COST_MEMORY * self.seconds + seconds
        self.num_drafts = PROPOSE_COST_MEMORY * self.num_drafts + num_drafts

    @property
    def per_draft_s(self) -> float:
        # A call that only caught up (no drafts yet) still counts: its seconds are spread over
        # the drafts that follow it.
        return self.seconds / self.num_drafts if self.num_drafts > 0 else 0.0


class DraftScheduling:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.max_k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        # A draft model writes its own K/V for the positions it guesses, in the request's blocks
        # (same block table): a decode step reserves room for them beyond its verified tokens.
        self.lookahead_slots = config.num_speculative_tokens if config.method == "draft" else 0
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self.controller = SpecController(config.num_speculative_tokens, adaptive=config.adaptive)
        self.propose_cost = ProposeCost()

    def usable_drafts(self, request: Request) -> int:
        """Drafts `request` could verify now, before any cost consideration."""
        if not request.draft_token_ids:
            return 0
        params = request.sampling_params
        limit = self.max_k if params.num_speculative_tokens is None else min(self.max_k, params.num_speculative_tokens)
        # All k accepted emit k + 1 tokens: past max_tokens they would be dropped unread, and the
        # positions computed this step (up to num_tokens - 1 + k) must stay inside the window.
        limit = min(limit, request.tokens_left(self.max_model_len) - 1)
        return max(0, min(limit, len(request.draft_token_ids)))

    def choose(self, decodes: Sequence[Request], step_cost: tuple[float, float] | None) -> dict[str, int]:
        """k per decoding request this step (missing: 0). `decodes` are the requests step 1 will
        schedule one token each, in schedule order: the step's size without drafts. `step_cost`:
        the scheduler's (fixed seconds, seconds per token) fit, None before it has one."""
        offers = [DraftOffer(r.request_id, n) for r in decodes if (n := self.usable_drafts(r)) > 0]
        if not decodes:
            return {}
        # Called with no offers too: the controller's view of the step (its break-even, whether a
        # probe would pay) decides which drafts the proposer makes after it.
        cost = None
        if step_cost is not None:
            cost = StepCost(step_cost[0], step_cost[1], draft_token_s=self.propose_cost.per_draft_s)
        return self.controller.choose(offers, len(decodes), cost)

    def proposed(self, seconds: float, num_drafts: int) -> None:
        """The runner's proposer took `seconds` to make `num_drafts` drafts after a step."""
        if seconds > 0 or num_drafts > 0:
            self.propose_cost.add(seconds, num_drafts)

    def drafts_wanted(self, request: Request, num_drafts: int) -> int:
        """Drafts worth proposing for `request` after this step, which verifies `num_drafts` of its
        drafts; counts a decode without drafts towards the controller's next probe."""
        if num_drafts == 0 and not request.draft_token_ids:
            self.controller.decoded_without_drafts(request.request_id)
        return self.controller.drafts_wanted(request.request_id)

    def verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A step verified `num_drafted` of `request`'s drafts and accepted the first `num_accepted`."""
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafted
        counters.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1
        self.controller.observe(request.request_id, num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        """The request finished or lost its KV: nothing of it is kept."""
        self.controller.forget(request_id)
