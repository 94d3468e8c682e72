"""The goodput controller: how many draft tokens each request verifies this step (k, 0 allowed).

Contract (implemented in this module; the scheduler is the one caller):

    controller = SpecController(max_k=config.num_speculative_tokens, adaptive=config.adaptive)
    ks = controller.choose(offers, num_step_tokens, cost)   # in schedule(), once per step
    controller.observe(request_id, num_drafted, num_accepted)  # in update(), per verified request
    controller.forget(request_id)                           # request finished / preempted

- `offers`: requests that hold drafts this step (maybe none: the call still tells the controller
  the step's size, which decides the drafts worth making after it), each with how many it may verify
  (`DraftOffer.num_available`, already capped by max_tokens, the context window, the API's
  per-request override and max_k).
- `num_step_tokens`: tokens the step carries without any draft (its decodes, plus prefill chunks
  when the scheduler knows them).
- `cost`: the scheduler's step-cost fit (seconds = fixed + per_token × tokens) and the proposer's
  measured seconds per draft token, None before the scheduler has a fit.
- Returns {request_id: k} with 0 <= k <= num_available for every offer (missing = 0).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class DraftOffer:
    request_id: str
    num_available: int  # drafts on hand it may verify this step (>= 1)


@dataclass(frozen=True)
class StepCost:
    fixed_s: float  # seconds a step costs whatever its size
    per_token_s: float  # seconds each scheduled token adds
    # Seconds the proposer spends per draft it makes: ~0 for token lookups, a draft model's
    # forwards for `draft` (shared by the requests drafting in one forward, so it falls with batch).
    draft_token_s: float = 0.0


# Before the scheduler has a step-cost fit: a step's fixed part is taken to be worth this many
# tokens. Small on purpose (this CPU measures ~7.5, a GPU hundreds): a cheap first draft still pays
# at batch 1, the fade-out comes early, and the first observations arrive before the fit.
PRIOR_FIXED_TOKENS = 4.0
# The global acceptance a fresh controller starts from, and how many drafts' worth it counts.
PRIOR_ACCEPTANCE = 0.5
PRIOR_ACCEPTANCE_TRIALS = 4.0
# Each request's estimate starts as the global average counted as this many drafts.
REQUEST_PRIOR_TRIALS = 4.0
# Memory per draft tried: a request's estimate weighs its last ~50 drafts, the global one ~500.
REQUEST_MEMORY = 0.98
GLOBAL_MEMORY = 0.998
# A request's last ~10 drafts, watched for a change of text: when their acceptance is CHANGE_Z
# standard errors away from the long estimate, the long estimate restarts from them.
RECENT_MEMORY = 0.9
CHANGE_Z = 2.5
# Hysteresis: a request's k rises as soon as its estimated acceptance says so, and falls only once
# the estimate is HYSTERESIS_Z standard errors below what its k needs. The band follows the
# estimate's own noise: wide for a young or middling estimate, narrow for a sure one; one-sided, so
# a new request starts at the estimate's best k and keeps collecting evidence.
HYSTERESIS_Z = 2.5
# A request held at k = 0 verifies one draft every PROBE_EVERY steps it offers drafts, and again
# (twice as many) the next step while its probes do well, so a text that turns repetitive is noticed
# within tens of steps; only while a draft accepted with PROBE_ACCEPTANCE would pay at this step.
PROBE_EVERY = 16
PROBE_ACCEPTANCE = 0.8
# A proposer that costs time (a draft model's forward) probes less often: its probes (making the
# draft and verifying it) take at most this share of the step time of a request held at k = 0, as
# the cost model prices them. It prices them low: a 1-draft probe of the default model's first 8
# layers measured 7.5 ms to propose, ~1.5 ms of bookkeeping around it and +3 ms to verify on a
# 22 ms decode step, where the fit's per-token cost says ~1 ms for the verification (the fit
# is dominated by prefill tokens, which are cheaper per token than a decode's second position).
PROBE_TIME_SHARE = 0.01
_PROBE_DUE = 1 << 30  # steps_at_zero that makes the next probe due whatever the interval


@dataclass
class _Acceptance:
    """Discounted Beta counts of one geometric acceptance process.

    Drafts are checked in order and checking stops at the first rejection, so a verification of
    k drafts with a accepted saw a successes and, when a < k, one failure; the drafts after it
    were never tried. The maximum-likelihood acceptance of that truncated geometric law is
    accepted / tried, which is what these counts hold, each older draft tried weighted down by
    `memory`."""

    memory: float
    accepted: float = 0.0
    tried: float = 0.0

    def add(self, num_drafted: int, num_accepted: int) -> None:
        num_tried = num_accepted + (1 if num_accepted < num_drafted else 0)
        decay = self.memory**num_tried
        self.accepted = decay * self.accepted + num_accepted
        self.tried = decay * self.tried + num_tried

    def mean(self, prior: float, prior_trials: float) -> float:
        return (self.accepted + prior * prior_trials) / (self.tried + prior_trials)

    def band(self, prior: float, prior_trials: float) -> _Band:
        mean = self.mean(prior, prior_trials)
        spread = HYSTERESIS_Z * math.sqrt(mean * (1.0 - mean) / (self.tried + prior_trials))
        return _Band(mean, keep=min(1.0, mean + spread))

    def departs_from(self, longer: _Acceptance) -> bool:
        """Are these (recent) drafts CHANGE_Z standard errors away from what `longer` expects?"""
        if self.tried <= 0 or longer.tried <= 0:
            return False
        expected = longer.accepted / longer.tried
        difference = abs(self.accepted / self.tried - expected)
        return difference > CHANGE_Z * math.sqrt(expected * (1.0 - expected) / self.tried)


@dataclass(frozen=True)
class _Band:
    """A request's acceptance estimate and the hysteresis band around it."""

    mean: float
    keep: float  # a draft j it had stays while keep ** j beats the break-even (a new one needs mean ** j)


@dataclass
class _RequestState:
    acceptance: _Acceptance = field(default_factory=lambda: _Acceptance(REQUEST_MEMORY))
    recent: _Acceptance = field(default_factory=lambda: _Acceptance(RECENT_MEMORY))
    wanted_k: int = 0  # its k last step had it max_k drafts on hand: the hysteresis anchor
    steps_at_zero: int = 0  # steps it offered drafts and got k = 0 since its last probe
    probe_k: int = 1  # drafts its next probe verifies: doubles while probes are all accepted
    probing: bool = False  # its k this step is a probe (observe() grades it)

    def with_probe(self, k: int, num_available: int, may_probe: bool, probe_every: int) -> int:
        """k, or a probe in its place when the request has sat at k = 0 for `probe_every` steps."""
        self.probing = False
        if k > 0:
            self.steps_at_zero, self.probe_k = 0, 1
            return k
        self.steps_at_zero += 1
        if self.steps_at_zero < probe_every or not may_probe:
            return 0
        self.steps_at_zero, self.probing = 0, True
        return min(self.probe_k, num_available)

    def probed(self, num_drafted: int, num_accepted: int, max_k: int) -> None:
        """A probe's outcome. At least half accepted: probe again next step, twice as many if all
        were (a repetitive stretch earns back its k in a few steps, not a few hundred); else back
        to one draft per probe interval."""
        if 2 * num_accepted >= num_drafted:
            grown = 2 * num_drafted if num_accepted == num_drafted else num_drafted
            self.steps_at_zero, self.probe_k = _PROBE_DUE, min(grown, max_k)
        else:
            self.probe_k = 1


class SpecController:
    """Chooses k per request to maximise the step's expected useful tokens per second.

    A step of N tokens costs T(N) = fixed + per_token × N. The step's undrafted tokens are useful
    work (a decode emits one token; a prefill token is work the step does anyway); the j-th draft
    of a request with acceptance α emits a token with probability α^j, so k drafts yield
    (1 - α^(k+1)) / (1 - α) tokens with its decode. A draft costs its verification (per_token)
    plus its making (draft_token: a draft model's forward). Adding one raises tokens / T exactly
    when its α^j beats the break-even (per_token + draft_token) × tokens / T, and the best drafts
    go first (greedy; optimal here, since every draft costs the same and each request's gains fall
    with j). As the batch grows tokens / T tends to 1 / per_token, the break-even passes 1, and k
    falls to 0 one draft at a time: no batch-size threshold. A draft costing as much as a step
    never pays: a poor draft model turns itself off.

    Not thread-safe; the scheduler calls it from its one thread. All methods are safe to call
    for unknown request ids.
    """

    def __init__(self, max_k: int, adaptive: bool = True) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.adaptive = adaptive
        self._global = _Acceptance(GLOBAL_MEMORY)
        self._requests: dict[str, _RequestState] = {}
        self._probe_every = PROBE_EVERY  # steps between probes at the last step's costs
        self._break_even: float | None = None  # the last step's, once a step has chosen

    def choose(self, offers: Sequence[DraftOffer], num_step_tokens: int, cost: StepCost | None) -> dict[str, int]:
        """k per offer (0 <= k <= num_available) for this step; see the module docstring."""
        _check_step(offers, num_step_tokens, cost)
        if not self.adaptive:
            return {offer.request_id: min(self.max_k, offer.num_available) for offer in offers}
        # Before a fit there is no time unit to charge a draft model's seconds in: its first steps
        # are priced as a lookup's; the fit comes within a few steps.
        fixed_s, per_token_s, draft_s = (
            (cost.fixed_s, cost.per_token_s, cost.draft_token_s) if cost else (PRIOR_FIXED_TOKENS, 1.0, 0.0)
        )
        step_s = fixed_s + per_token_s * num_step_tokens
        # A probe makes a draft (draft_s) and verifies it (per_token_s): for a lookup the interval's
        # floor holds; a draft model's forward spaces them out.
        probe_s = draft_s + per_token_s
        interval = probe_s / (PROBE_TIME_SHARE * step_s) if step_s > 0 else 0.0  # a step of nothing: the floor
        self._probe_every = max(PROBE_EVERY, math.ceil(min(interval, _PROBE_DUE)))
        states = [self._requests.setdefault(offer.request_id, _RequestState()) for offer in offers]
        prior = self._global_mean()
        bands = [state.acceptance.band(prior, REQUEST_PRIOR_TRIALS) for state in states]
        self._break_even = break_even = _break_even(
            [band.mean for band in bands],
            [min(self.max_k, offer.num_available) for offer in offers],
            _Step(float(num_step_tokens), step_s, per_token_s + draft_s),
        )
        may_probe = self._may_probe()
        ks: dict[str, int] = {}
        for offer, state, band in zip(offers, states, bands):
            # Hysteresis: last step's k stands while it is the best k for some acceptance in the band.
            lowest = _num_paying(band.mean, break_even, self.max_k)
            highest = _num_paying(band.keep, break_even, self.max_k)
            state.wanted_k = min(max(state.wanted_k, lowest), highest)
            k = min(state.wanted_k, offer.num_available)
            ks[offer.request_id] = state.with_probe(k, offer.num_available, may_probe, self._probe_every)
        return ks

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """One verification of `num_drafted` drafts, the first `num_accepted` of them accepted."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(
                f"observe({request_id!r}): need 0 <= num_accepted <= num_drafted, got {num_accepted}, {num_drafted}"
            )
        if num_drafted == 0:
            return
        state = self._requests.setdefault(request_id, _RequestState())
        state.acceptance.add(num_drafted, num_accepted)
        state.recent.add(num_drafted, num_accepted)
        if state.recent.departs_from(state.acceptance):  # the text changed: its old drafts say nothing
            state.acceptance = replace(state.recent, memory=REQUEST_MEMORY)
        if state.probing:
            state.probed(num_drafted, num_accepted, self.max_k)
        self._global.add(num_drafted, num_accepted)

    def drafts_wanted(self, request_id: str) -> int:
        """How many drafts the request's next step could use: the proposer need not make more (a
        draft model pays a forward for every guess). Its k plus one (room to grow), a probe when
        one is due, else 0. A request not seen yet (its prompt just finished) is judged by the
        global acceptance at the last step's break-even, as choose() would judge it: when that
        pays nothing it waits for its first probe like a request held at k = 0 (a draft model's
        first guesses for every new request were most of its cost on text it cannot guess);
        max_k before any step has chosen."""
        if not self.adaptive:
            return self.max_k
        state = self._requests.get(request_id)
        if state is None:
            if self._break_even is None:
                return self.max_k
            k = _num_paying(self._global_mean(), self._break_even, self.max_k)
            if k > 0:
                return min(self.max_k, k + 1)
            state = self._requests[request_id] = _RequestState()  # counts its steps towards a probe
        if state.wanted_k > 0:
            return min(self.max_k, state.wanted_k + 1)
        if not self._may_probe() or state.steps_at_zero + 1 < self._probe_every:
            return 0  # no probe is due, or none would pay at the last step's size: no drafts to make
        # Its probe's drafts are made now: the next choose() verifies them even if the interval it
        # computes has grown meanwhile (the proposer's cost moves with every call).
        state.steps_at_zero = _PROBE_DUE
        return state.probe_k

    def decoded_without_drafts(self, request_id: str) -> None:
        """The request decoded a step with no drafts on hand (none were wanted): it counts towards
        its next probe as a step at k = 0 does."""
        state = self._requests.get(request_id)
        if state is not None and state.wanted_k == 0:
            state.steps_at_zero += 1

    def _may_probe(self) -> bool:
        """Would a probe pay at the last step's break-even (yes before any step has chosen)?"""
        return self._break_even is None or self._break_even < PROBE_ACCEPTANCE

    def _global_mean(self) -> float:
        return self._global.mean(PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE_TRIALS)

    def forget(self, request_id: str) -> None:
        """Drop the request's acceptance and k (it finished, or was preempted: its next
        proposals start again from the global average). What it taught the global average stays."""
        self._requests.pop(request_id, None)


@dataclass
class _Step:
    """The step as drafts are added: expected useful tokens and predicted seconds."""

    tokens: float
    seconds: float
    per_draft_s: float  # what one more draft adds: its verification and its making

    @property
    def break_even(self) -> float:
        """Acceptance gain a draft needs to raise tokens / seconds."""
        return self.per_draft_s * self.tokens / self.seconds if self.seconds > 0 else 0.0


def _break_even(acceptances: list[float], caps: list[int], step: _Step) -> float:
    """The step's break-even gain once the drafts that pay are in: greedy, best gain first."""
    ks = [0] * len(acceptances)
    candidates = [(-acceptance, i) for i, acceptance in enumerate(acceptances) if caps[i] > 0]
    heapq.heapify(candidates)
    while candidates and -candidates[0][0] > step.break_even:
        negative_gain, i = heapq.heappop(candidates)
        ks[i] += 1
        step.tokens += -negative_gain
        step.seconds += step.per_draft_s
        if ks[i] < caps[i]:
            heapq.heappush(candidates, (-(acceptances[i] ** (ks[i] + 1)), i))
    return step.break_even


def _num_paying(acceptance: float, break_even: float, max_k: int) -> int:
    """How many drafts j = 1..max_k have acceptance ** j above the break-even."""
    k = 0
    while k < max_k and acceptance ** (k + 1) > break_even:
        k += 1
    return k


def _check_step(offers: Sequence[DraftOffer], num_step_tokens: int, cost: StepCost | None) -> None:
    ids = [offer.request_id for offer in offers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"choose(): a request offered twice in one step: {sorted(ids)}")
    short = [offer for offer in offers if offer.num_available < 1]
    if short:
        raise ValueError(f"choose(): offers need num_available >= 1, got {short}")
    if num_step_tokens < len(offers):
        raise ValueError(
            f"choose(): num_step_tokens {num_step_tokens} < {len(offers)} offers (each offer's decode is a step token)"
        )
    if cost is not None and (
        cost.fixed_s < 0 or cost.per_token_s < 0 or cost.draft_token_s < 0 or cost.fixed_s + cost.per_token_s <= 0
    ):
        raise ValueError(
            f"choose(): cost needs fixed_s, per_token_s, draft_token_s >= 0, fixed_s + per_token_s > 0, got {cost}"
        )
