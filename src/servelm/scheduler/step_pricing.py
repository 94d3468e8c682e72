"""What one step may still take in time, as the scheduler fills it: the step-time bound.

A step is never interrupted, so whatever arrives while it runs waits for its end: the step's
length is how long a new request can wait before it is even looked at. Every step is therefore
held to a time target (`max_step_ms`; by default chosen at start-up, `auto_step_target_s`), not
only the steps that carry decodes: a 3,801-token prompt alone once ran as one 9 s step and a
16-token request behind it waited 8.9 s for its first token (2 AMD cores, the default model).

    target ─┬─ decodes' TBT:  TBT_STEP_SHARE x the tightest class TBT among the decodes
            ├─ decodes' pace: max_decode_slowdown x what the step's decodes alone take (decode_bound_s),
            │                 FINISH_SLOWDOWN x while a stream's last tokens cost the prompts little
            └─ first tokens:  a step that completes a prompt ends within FIRST_TOKEN_SHARE x target
    predicted(step) = cost model over the step's shape (step_cost.py), summed as it is filled

The scheduler adds, in its order, decodes (never cut), prompts that finish whole, then the next
chunk of a long prompt: as many tokens as the time left allows (`largest_chunk`), or, where a token
chunk that small would spend more than MAX_CHUNK_OVERHEAD of its time on the parts every chunk pays
(a pass over the weights, re-reading its context), a large chunk run a few layers a step
(`layered_chunk_tokens`, `layers_within`; layered prefill, worker/layered_chunks.py).

Without a target (max_step_ms 0) or before the cost model has a fit, time is no constraint here:
every question answers as if the step had room (the token budget alone binds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from servelm.datatypes import SchedulerOutput
from servelm.scheduler.request import Request
from servelm.scheduler.step_cost import (
    FEATURES,
    TBT_STEP_SHARE,
    StepCostModel,
    StepShape,
    chunk_pairs,
    step_time_target_s,
)

# Where the cost model's coefficients (FEATURES order) price what a prompt chunk adds.
_DENSE_PASSES, _PROMPT_TOKENS, _PROMPT_PAIRS, _CHUNK_CONTEXT = (
    FEATURES.index(name) for name in ("dense_passes", "prompt_tokens", "prompt_pairs", "chunk_context")
)

# The default target (max_step_ms unset) bounds what chunking a lone long prompt may lose: a step
# repeats what every step pays (Python, launching, sampling) and a chunk repeats a pass over the
# weights (with layered prefill a chunk spans many steps: one of its layers may take
# LONE_LAYER_SHARE of the target, so it runs num_layers x LONE_LAYER_SHARE targets' worth). The
# target is AUTO_TARGET_FACTOR times those repeated costs per target's worth of work, so they take
# at most 1/AUTO_TARGET_FACTOR of the prompt's time (~8%: room for what the model does not see,
# inside the 10% a lone prompt may lose). ~75-100 ms on 2 AMD Zen 4 cores and the default model,
# tens of milliseconds on a GPU. Clamped to [AUTO_TARGET_MIN_S, AUTO_TARGET_MAX_S]. Pricing the pass
# per step instead, as if every step started a chunk, gave 440 ms on an AMX Xeon host, where a
# 16-token request sent beside an 8k-token prompt then waited 0.54 s for its first token. 15 gave
# 89-115 ms once the calibration stopped under-timing the fixed part (2 AMD cores), and the mixed
# profile's voice TBT p99 rose from 33 ms (at 86 ms) to 51 ms, past half of vLLM's.
AUTO_TARGET_FACTOR = 13.0
AUTO_TARGET_MIN_S = 0.02
AUTO_TARGET_MAX_S = 1.0
# A step that completes a prompt delivers its first token at its end: it ends within this share of
# the target, so a short request arriving next to a long prefill waits for the step in flight and
# a short one of its own, while the long prompt still gets at least this share of every step.
FIRST_TOKEN_SHARE = 0.5
# A token chunk that would spend more than this share of its predicted time on what every chunk
# pays whatever its size (the step's pass over the weights, re-reading its cached context) runs as
# a layered chunk instead.
MAX_CHUNK_OVERHEAD = 0.1
# A step's chunks after this many tokens of their prompt count as deep for the prediction metric
# (servelm:step_time_prediction_ratio{kind}): where attention over the context outweighs the chunk's
# own matmuls on a CPU, and a model of tokens alone used to go wrong.
DEEP_CONTEXT = 1024
# One layer of a layered chunk costs at most this share of the target, so a step's time left can
# be filled a layer at a time; and since a chunk's layers are sized when it starts, a stream that
# starts decoding mid-chunk (its steps then held to max_decode_slowdown x its decode) waits for at
# most one such layer beside its decode. Smaller layers mean more chunks, each paying a pass over
# the weights and a re-read of its context: a lone 8k-token prompt took 1.16x its unchunked time at
# 0.15 and 1.03x at 0.5 (2 AMD cores), so a prompt alone on the engine gets LONE_LAYER_SHARE and
# takes the risk of a stream arriving mid-chunk; with other requests about, LAYER_SHARE.
LAYER_SHARE = 0.15
LONE_LAYER_SHARE = 0.5
# A lone prompt's step (LONE_LAYER_SHARE: nothing else in the engine, no class's TBT or decodes'
# pace to keep) takes one more layer of its layered chunk when all but this share of the layer's
# predicted time is left: a chunk is sized at one target and its layers are priced again each
# step, by a fit refitted meanwhile, so k layers sized to fill a step often fit k - 1 times once
# the price rose a little. Strictly (no tolerance) a lone 8k-token prompt's
# steps took one layer of two, 438-504 steps where 315-340 did with this tolerance (2 AMD cores,
# an 85 ms target: 4-8% of its TTFT); a step then runs over its target by at most this share
# of a layer (a layer: at most LONE_LAYER_SHARE of the target), within the step-time bound's margin.
LAYER_TOLERANCE = 0.15
# Shortest remaining work first, within the pace bound: a stream whose last tokens are near is paced
# at FINISH_SLOWDOWN instead of max_decode_slowdown where running all its remaining steps that way
# costs the prompts beside it at most FINISH_COST_SHARE of the quickest one's prefill time left. A
# 16-token request sent beside an 8k-token prompt spent 15 steps at 2.5x a decode alone (~30 ms
# each on 2 CPU cores) after its first token and was done 0.6 s after it was sent; the prompt, with
# seconds of prefill left, gains nothing it would miss from those steps. The cost is counted once
# per stream (all of its remaining steps), so a stream cannot take the share again step by step.
FINISH_SLOWDOWN = 1.5
FINISH_COST_SHARE = 0.05


def auto_step_target_s(model: StepCostModel, num_layers: int) -> float | None:
    """The default step-time target for an engine whose cost model is calibrated (None before);
    `num_layers`: the model's layers where prefill may be layered, 0 where every chunk is a token
    chunk (one pass over the weights a step)."""
    parts = model.calibrated_parts_s
    if parts is None:
        return None
    every_step, dense_pass = parts
    chunks_per_target = 1.0 / (num_layers * LONE_LAYER_SHARE) if num_layers else 1.0
    repeated = every_step + chunks_per_target * dense_pass
    return min(AUTO_TARGET_MAX_S, max(AUTO_TARGET_MIN_S, AUTO_TARGET_FACTOR * repeated))


def decode_bound_s(model: StepCostModel, decodes: StepShape, slowdown: float) -> float | None:
    """The most a step carrying `decodes` (their shape alone) may take: `slowdown` times their
    predicted time by themselves (fixed part included), so their token gap grows at most that much
    while prompts prefill beside them. None: no bound (slowdown 0, no decodes, or no fit)."""
    if slowdown <= 0 or not decodes.decode_tokens:
        return None
    predicted = model.predict(decodes)
    return None if predicted is None else slowdown * predicted


def finishing_slowdown(model: StepCostModel, paced_decodes: StepShape, slowdown: float, tokens_left: int,
                       prompts_left_s: Iterable[float]) -> float:  # fmt: skip
    """The pace for a step whose `paced_decodes` hold a stream with at most `tokens_left` output
    tokens to come, beside prompts with `prompts_left_s` of prefill to go each: FINISH_SLOWDOWN
    where pacing all of the stream's remaining steps so costs every one of them at most
    FINISH_COST_SHARE of its time left, else `slowdown` (also without a fit or a prompt). The
    prompts' times are read only as far as the answer needs: pass them lazily."""
    if slowdown <= FINISH_SLOWDOWN:
        return slowdown
    decodes_s = model.predict(paced_decodes)
    if decodes_s is None:
        return slowdown
    prompts_lose_s = tokens_left * (slowdown - FINISH_SLOWDOWN) * decodes_s
    any_prompt = False
    for prompt_left_s in prompts_left_s:
        if prompts_lose_s > FINISH_COST_SHARE * prompt_left_s:
            return slowdown
        any_prompt = True
    return FINISH_SLOWDOWN if any_prompt else slowdown


def configured_step_target_s(model: StepCostModel, max_step_ms: float | None, num_layers: int) -> float | None:
    """The step-time target before any decode's class tightens it: max_step_ms, or when unset the
    default the calibrated cost model gives (auto_step_target_s); None: no target (0, or uncalibrated)."""
    if max_step_ms is None:
        return auto_step_target_s(model, num_layers)
    return max_step_ms / 1000.0 if max_step_ms > 0 else None


def paced_step_target_s(model: StepCostModel, base_s: float | None, tbt_targets_s: Iterable[float | None],
                        paced_decodes: StepShape | None, slowdown: float) -> tuple[float | None, bool]:  # fmt: skip
    """The step's time target: `base_s` or, tighter, the decoding requests' class TBT targets, or
    `slowdown` x the time of `paced_decodes` alone (the decodes a prompt's work must not slow
    more than that; None: no prompt work to hold to a pace). Also whether that pace is what binds."""
    target = step_time_target_s(1000.0 * base_s if base_s else 0.0, tbt_targets_s)
    pace = decode_bound_s(model, paced_decodes, slowdown) if paced_decodes is not None else None
    if pace is not None and (target is None or pace < target):
        return pace, True
    return target, False


@dataclass
class StepPricing:
    """The time side of one step's plan: its target and the predicted time of what it holds so far.
    Built and mutated by the Scheduler only, one per schedule() call."""

    model: StepCostModel
    target_s: float | None  # None: no bound
    num_layers: int  # the model's decoder layers (layered chunks); 0: no layered prefill
    layer_share: float = LAYER_SHARE  # of the target, one layer of a layered chunk at most
    paced: bool = False  # the target is the decodes' pace bound (max_decode_slowdown), tighter than the rest
    shape: StepShape = field(default_factory=StepShape)
    has_prompt: bool = False  # the step's main forward carries prompt tokens (its dense pass is in `shape`)
    base_target_s: float | None = field(init=False)  # the target before any first-token bound
    # (shape, coefficients, its predicted seconds) as last priced by _shape_s
    _priced_shape: tuple[StepShape, tuple[float, ...], float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.base_target_s = self.target_s

    # -- filling -------------------------------------------------------------------------

    def add_decode(self, num_tokens: int, context: int) -> None:
        self.shape = self.shape + StepShape.decode(num_tokens, context)

    def add_chunk(self, num_tokens: int, context: int) -> None:
        self.shape = self.shape + self._chunk_shape(num_tokens, context)
        self.has_prompt = True

    def add_slice(self, num_tokens: int, context: int, num_layers: int) -> None:
        """`num_layers` layers of a layered chunk: their share of the chunk, with their share of its pass."""
        self.shape = self.shape + self._slice_shape(num_tokens, context, num_layers)

    def bound_for_first_token(self, tbt_target_s: float | None = None) -> None:
        """A prompt completes this step: the step's end is that prompt's first token. The step ends
        within FIRST_TOKEN_SHARE of its own target and within TBT_STEP_SHARE of the prompt's class
        TBT target (`tbt_target_s`), but never before what it already holds."""
        bounds = [] if self.base_target_s is None else [FIRST_TOKEN_SHARE * self.base_target_s]
        if tbt_target_s is not None:
            bounds.append(TBT_STEP_SHARE * tbt_target_s)
        if not bounds:
            return
        bound = max(min(bounds), self.predicted_s() or 0.0)
        self.target_s = bound if self.target_s is None else min(self.target_s, bound)

    # -- questions -----------------------------------------------------------------------

    def predicted_s(self) -> float | None:
        coefficients = self.model.coefficients()
        return None if coefficients is None else self._shape_s(coefficients)

    def priced(self) -> bool:
        """Whether time binds this step: a target and a fit to price against it."""
        return self.target_s is not None and self.model.coefficients() is not None

    def time_left_s(self) -> float:
        if not self.priced():
            return math.inf
        assert self.target_s is not None
        return self.target_s - (self.predicted_s() or 0.0)

    def fits_chunk(self, num_tokens: int, context: int) -> bool:
        """Would the step, with this chunk added, still end within the target?"""
        coefficients = self.model.coefficients()
        if self.target_s is None or coefficients is None:
            return True
        return self._shape_s(coefficients) + self._chunk_s(coefficients, num_tokens, context) <= self.target_s

    def largest_chunk(self, limit: int, context: int) -> int:
        """Most tokens (at most `limit`) of a chunk after `context` that keep the step within the target."""
        if limit <= 0 or self.fits_chunk(limit, context):
            return max(0, limit)
        low, high = 0, limit  # fits(low), not fits(high): the cost only grows with the chunk
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.fits_chunk(middle, context) else (low, middle)
        return low

    def chunk_overhead_share(self, num_tokens: int, context: int) -> float:
        """Share of a chunk's own predicted time spent on what any chunk pays whatever its size (a
        pass over the weights unless the step already makes one, re-reading its context); 0 without
        a fit."""
        coefficients = self.model.coefficients()
        if coefficients is None or num_tokens <= 0:
            return 0.0
        total = self._chunk_s(coefficients, num_tokens, context)
        overhead = coefficients[_CHUNK_CONTEXT] * context + (0.0 if self.has_prompt else coefficients[_DENSE_PASSES])
        return overhead / total if total > 0 else 0.0

    def layered_chunk_tokens(self, limit: int, context: int) -> int:
        """The chunk a layered prefill runs after `context`: the most tokens (at most `limit`) one of
        whose layers costs at most layer_share of the target's time for work (the target less what
        every step pays), so a step can always fit one and, at a share of 1/k, fits k whole: a share
        of the target itself left a lone prompt's steps (share 0.5) one layer and half empty. At
        least 1."""
        if not self.priced() or self.num_layers <= 0:
            return max(1, limit)
        assert self.target_s is not None
        every_step = self.model.predict(StepShape()) or 0.0
        layer_budget = self.layer_share * max(0.0, self.target_s - every_step)
        low, high = 1, max(1, limit)
        if self._slice_cost(high, context, 1) <= layer_budget:
            return high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self._slice_cost(middle, context, 1) <= layer_budget else (low, middle)
        return low

    def layers_within(self, num_tokens: int, context: int, max_layers: int) -> int:
        """Most layers (at most `max_layers`) of a layered chunk that fit the time left (maybe 0),
        the last within LAYER_TOLERANCE for a lone prompt's step."""
        if not self.priced():
            return max_layers
        per_layer = self._slice_cost(num_tokens, context, 1)
        left = self.time_left_s()
        if per_layer <= 0:
            return max_layers
        tolerance = LAYER_TOLERANCE if self.layer_share == LONE_LAYER_SHARE and not self.paced else 1e-9
        return max(0, min(max_layers, int(left / per_layer + tolerance)))

    # -- shapes --------------------------------------------------------------------------

    # The model is linear in a shape's counts, so a candidate chunk is priced as the step's time
    # so far (computed once per shape) plus the chunk's own terms, without building shapes: the
    # scheduler asks this for every waiting prompt it considers, ~10 times each in largest_chunk's
    # search (as shapes, a third of a scheduling step's Python).
    def _shape_s(self, coefficients: tuple[float, ...]) -> float:
        cached = self._priced_shape
        if cached is None or cached[0] is not self.shape or cached[1] is not coefficients:
            cached = (self.shape, coefficients, sum(c * x for c, x in zip(coefficients, self.shape.features())))
            self._priced_shape = cached
        return cached[2]

    def _chunk_s(self, coefficients: tuple[float, ...], num_tokens: int, context: int) -> float:
        """What `_chunk_shape(num_tokens, context)` adds to the step's predicted time."""
        seconds = (coefficients[_PROMPT_TOKENS] * num_tokens + coefficients[_PROMPT_PAIRS] * chunk_pairs(num_tokens, context)
                   + coefficients[_CHUNK_CONTEXT] * context)  # fmt: skip
        return seconds if self.has_prompt else seconds + coefficients[_DENSE_PASSES]

    def _chunk_shape(self, num_tokens: int, context: int) -> StepShape:
        pass_shape = StepShape() if self.has_prompt else StepShape(dense_passes=1.0)
        return pass_shape + StepShape.chunk(num_tokens, context)

    def _slice_shape(self, num_tokens: int, context: int, num_layers: int) -> StepShape:
        share = num_layers / self.num_layers if self.num_layers else 1.0
        return StepShape(dense_passes=share) + StepShape.chunk(num_tokens, context, share)

    def _slice_cost(self, num_tokens: int, context: int, num_layers: int) -> float:
        coefficients = self.model.coefficients()
        if coefficients is None:
            return 0.0
        shape = self._slice_shape(num_tokens, context, num_layers)
        return sum(c * x for c, x in zip(coefficients[1:], shape.counts()))


def executed_shape(scheduler_output: SchedulerOutput, requests: Mapping[str, Request], model: StepCostModel,
                   num_layers: int) -> tuple[StepShape, str]:  # fmt: skip
    """What a step computed, from its SchedulerOutput and its requests as they were when it was
    planned, and its kind: "decode" (no prompt work), "deep" (a chunk after DEEP_CONTEXT tokens or
    more of its prompt) or "shallow". Requests gone since (aborted) are left out."""
    pricing = StepPricing(model, None, num_layers)
    deepest = -1
    slices = scheduler_output.layer_slices
    for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
        request = requests.get(request_id)
        if request is None or request_id in slices:
            continue
        if request.is_prefilling:
            pricing.add_chunk(num_scheduled, request.num_computed_tokens)
            deepest = max(deepest, request.num_computed_tokens)
        else:
            pricing.add_decode(num_scheduled, request.num_computed_tokens)
    for request_id, layers in slices.items():
        request = requests.get(request_id)
        if request is not None:
            pricing.add_slice(layers.num_tokens, request.num_computed_tokens, layers.end_layer - layers.start_layer)
            deepest = max(deepest, request.num_computed_tokens)
    kind = "decode" if deepest < 0 else "deep" if deepest >= DEEP_CONTEXT else "shallow"
    return pricing.shape, kind
