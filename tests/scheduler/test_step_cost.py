"""StepCostModel: non-negative least squares of step time over what a step computes, calibrated at
start-up and refined by the steps the engine runs; and StepPricing's questions over it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from servelm.scheduler.chunk_choice import choose_chunk
from servelm.scheduler.step_cost import REFIT_EVERY, StepCostModel, StepShape, chunk_pairs
from servelm.scheduler.step_plan import ChunkPlan, StepPlan
from servelm.scheduler.step_pricing import (
    AUTO_TARGET_FACTOR,
    AUTO_TARGET_MAX_S,
    AUTO_TARGET_MIN_S,
    LONE_LAYER_SHARE,
    MAX_CHUNK_OVERHEAD,
    StepPricing,
    auto_step_target_s,
    configured_step_target_s,
    paced_step_target_s,
)

TRUTH = (0.002, 0.008, 0.001, 2e-7, 0.0005, 1e-6, 1e-5)


def seconds(shape: StepShape, truth: tuple[float, ...] = TRUTH) -> float:
    return sum(c * x for c, x in zip(truth, shape.features()))


def calibration_shapes() -> list[StepShape]:
    shapes = [StepShape(dense_passes=1) + StepShape.chunk(n, 0) for n in (16, 64, 192)]
    shapes += [StepShape(dense_passes=0.1) + StepShape.chunk(n, d, 0.1) for n, d in ((128, 1024), (256, 2048), (32, 4096))]
    return shapes + [StepShape.decode(1, d) for d in (16, 1024, 4096)] + [StepShape.decode(4, 16)]


def calibrated(truth: tuple[float, ...] = TRUTH) -> StepCostModel:
    model = StepCostModel()
    model.calibrate([(shape, seconds(shape, truth)) for shape in calibration_shapes()])
    return model


def test_no_answer_before_a_calibration_or_four_steps_of_different_sizes() -> None:
    model = StepCostModel()
    assert model.coefficients() is None and model.predict(StepShape.decode(1, 10)) is None
    for _ in range(4):
        model.observe(StepShape.decode(1, 10), 0.01)  # one size: no slope
    assert model.coefficients() is None
    assert auto_step_target_s(model, 30) is None  # nothing calibrated: no default target


def test_the_calibration_recovers_every_price() -> None:
    model = calibrated()
    assert model.coefficients() == pytest.approx(TRUTH, rel=1e-3)
    deep = StepShape(dense_passes=1) + StepShape.chunk(16, 6144)  # a small chunk deep in a prompt
    assert model.predict(deep) == pytest.approx(seconds(deep), rel=1e-3)
    assert model.calibrated_fixed_s == pytest.approx(TRUTH[0] + TRUTH[1], rel=1e-3)


def test_the_window_moves_the_prices_with_the_machine_and_the_calibration_holds_the_rest() -> None:
    """The machine runs 2x slower than at start-up on the steps it now runs (decodes and shallow
    chunks); the fit follows within a window. Chunk context, which no window step varies, stays
    near its calibrated price (the prior still holds it); the default target stays put."""
    model = calibrated()
    slow = tuple(2 * c for c in TRUTH)
    rng = random.Random(0)
    for _ in range(model.window):
        shape = StepShape.decode(rng.randint(1, 8), 100) + StepShape(dense_passes=1) + StepShape.chunk(rng.randint(16, 400), 0)
        model.observe(shape, seconds(shape, slow))
    probe = StepShape.decode(4, 100) + StepShape(dense_passes=1) + StepShape.chunk(200, 0)
    assert model.predict(probe) == pytest.approx(seconds(probe, slow), rel=0.05)
    assert model.coefficients()[6] == pytest.approx(TRUTH[6], rel=0.5)
    assert model.calibrated_fixed_s == pytest.approx(TRUTH[0] + TRUTH[1], rel=1e-3)


def test_noise_never_makes_a_price_negative_and_empty_steps_are_ignored() -> None:
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(64):
        model.observe(StepShape.decode(rng.randint(1, 64), rng.randint(0, 4000)), rng.uniform(0.005, 0.02))
    model.observe(StepShape(), 5.0)
    coefficients = model.coefficients()
    assert coefficients is not None and all(c >= 0 for c in coefficients)


def test_a_fit_that_puts_a_decodes_whole_cost_on_its_context_gives_no_decode_cost() -> None:
    """Seen in CI: a tiny model's decodes at growing depth, priced by the context alone, left the
    speculation controller a decode step costing 0 s fixed and 0 s a token, which it refuses."""
    model = StepCostModel()
    for context in range(100, 2000, 50):
        model.observe(StepShape.decode(1, context), 2e-6 * context)
    coefficients = model.coefficients()
    assert coefficients is not None and coefficients[0] + coefficients[2] + coefficients[4] < 1e-8
    assert model.decode_cost() is None
    assert calibrated().decode_cost() == pytest.approx((TRUTH[0] + TRUTH[2], TRUTH[4]), rel=1e-3)


def test_it_refits_every_few_steps_not_every_step() -> None:
    model = calibrated()
    first = model.coefficients()
    for _ in range(REFIT_EVERY - 1):
        model.observe(StepShape.decode(1, 10), 1.0)  # wildly slower
    assert model.coefficients() == first
    model.observe(StepShape.decode(1, 10), 1.0)
    assert model.coefficients() != first


def test_prompt_blocks_are_priced_by_their_tokens_and_pairs_at_depth_without_the_fixed_part() -> None:
    model = calibrated()
    blocks = model.prompt_blocks_s(16, 2048, 3)
    assert blocks is not None
    for i, block_s in enumerate(blocks):
        assert block_s == pytest.approx(TRUTH[4] * 16 + TRUTH[5] * chunk_pairs(16, 2048 + 16 * i), rel=1e-3)
    assert StepCostModel().prompt_blocks_s(16, 0, 3) is None


def test_the_default_target_prices_what_chunking_repeats_and_is_clamped() -> None:
    # Token chunks: every step starts a chunk, so it repeats its fixed part and a pass over the weights.
    token_chunks = auto_step_target_s(calibrated(), 0)
    assert token_chunks == pytest.approx(AUTO_TARGET_FACTOR * (TRUTH[0] + TRUTH[1]), rel=1e-3)
    # Layered chunks: a chunk spans num_layers x LONE_LAYER_SHARE targets, so its pass is shared by
    # that many steps' worth of work and the target is smaller (a request arriving waits less).
    layered = auto_step_target_s(calibrated(), 30)
    assert layered == pytest.approx(AUTO_TARGET_FACTOR * (TRUTH[0] + TRUTH[1] / (30 * LONE_LAYER_SHARE)), rel=1e-3)
    assert layered is not None and token_chunks is not None and layered < token_chunks
    assert auto_step_target_s(calibrated(tuple(c * 100 for c in TRUTH)), 0) == AUTO_TARGET_MAX_S
    assert auto_step_target_s(calibrated(tuple(c / 100 for c in TRUTH)), 30) == AUTO_TARGET_MIN_S


def test_the_step_target_is_the_tightest_of_the_setting_the_classes_and_the_pace() -> None:
    model = calibrated()
    assert configured_step_target_s(model, 250.0, 30) == 0.25 and configured_step_target_s(model, 0.0, 30) is None
    assert configured_step_target_s(model, None, 30) == auto_step_target_s(model, 30)
    assert paced_step_target_s(model, 0.25, [None], None, 2.0) == (0.25, False)  # no prompt work: no pace
    assert paced_step_target_s(model, 0.25, [0.05], None, 2.0) == (pytest.approx(0.05 * 0.8), False)  # a class's TBT
    decodes = StepShape.decode(4, 512)
    pace = 2.0 * seconds(decodes)
    assert pace < 0.25
    target, paced = paced_step_target_s(model, 0.25, [None] * 4, decodes, 2.0)
    assert paced and target == pytest.approx(pace, rel=1e-3)
    assert paced_step_target_s(model, pace / 2, [None] * 4, decodes, 2.0) == (pace / 2, False)  # the setting is tighter
    assert paced_step_target_s(model, 0.25, [None], decodes, 0.0) == (0.25, False)  # slowdown 0: no pace bound


def test_pricing_answers_the_largest_chunk_and_the_layers_that_fit() -> None:
    model = calibrated()
    pricing = StepPricing(model, 0.100, num_layers=10)
    pricing.add_decode(1, 500)
    for context in (0, 1000, 4000):
        chunk = pricing.largest_chunk(2048, context)
        with_chunk = pricing.shape + StepShape(dense_passes=1) + StepShape.chunk(chunk, context)
        one_more = pricing.shape + StepShape(dense_passes=1) + StepShape.chunk(chunk + 1, context)
        assert seconds(with_chunk) <= 0.100 + 1e-6 < seconds(one_more) + 1e-6
    tokens = pricing.layered_chunk_tokens(2048, 4000)
    one_layer = StepShape(dense_passes=0.1) + StepShape.chunk(tokens, 4000, 0.1)
    assert seconds(one_layer) - TRUTH[0] <= 0.05 + 1e-6  # a layer (no step's fixed part) within LAYER_SHARE of the target
    layers = pricing.layers_within(tokens, 4000, 10)
    assert 1 <= layers < 10 and pricing.time_left_s() >= layers * (seconds(one_layer) - TRUTH[0]) - 1e-6
    assert pricing.chunk_overhead_share(8, 4000) > 0.5 > pricing.chunk_overhead_share(1024, 0)


def test_a_lone_prompts_layered_chunk_fills_its_steps_with_whole_layers() -> None:
    """At a layer share of 1/k, k layers of the chunk fit a step that holds nothing else: the
    share is of the time a step has for work, not of the target (which left a lone prompt's steps
    one layer and half empty: twice the steps, twice what every step pays)."""
    model = calibrated()
    for target_s in (0.05, 0.15, 0.4):
        pricing = StepPricing(model, target_s, num_layers=30, layer_share=LONE_LAYER_SHARE)
        tokens = pricing.layered_chunk_tokens(8192, 2000)
        assert pricing.layers_within(tokens, 2000, 30) == 2, target_s
        strict = StepPricing(model, target_s, num_layers=30, layer_share=LONE_LAYER_SHARE, paced=True)  # no tolerance
        assert strict.layers_within(tokens + 1, 2000, 30) < 2 or tokens == 8192  # the largest chunk that fits two


def test_a_layer_priced_a_little_higher_than_when_its_chunk_was_sized_still_fits_unless_paced() -> None:
    """A chunk's layers are priced again every step, by a fit refitted meanwhile: a few percent
    more must not leave a lone prompt's step one layer (half empty). Beside other requests (a
    class's TBT, the decodes' pace), the step stays strictly within its target."""
    model = calibrated()
    sized = StepPricing(model, 0.15, num_layers=30, layer_share=LONE_LAYER_SHARE)
    tokens = sized.layered_chunk_tokens(8192, 2000)
    two_layers = StepShape(dense_passes=2 / 30) + StepShape.chunk(tokens, 2000, 2 / 30)
    work_s = seconds(two_layers) - TRUTH[0]
    tighter_s = TRUTH[0] + 0.95 * work_s  # the same layers now cost ~5% more than the time they have
    assert StepPricing(model, tighter_s, num_layers=30, layer_share=LONE_LAYER_SHARE).layers_within(tokens, 2000, 30) == 2
    paced = StepPricing(model, tighter_s, num_layers=30, layer_share=LONE_LAYER_SHARE, paced=True)
    assert paced.layers_within(tokens, 2000, 30) == 1
    assert StepPricing(model, tighter_s, num_layers=30).layers_within(tokens, 2000, 30) == 1  # not alone
    far_tighter_s = TRUTH[0] + 0.7 * work_s
    assert StepPricing(model, far_tighter_s, num_layers=30).layers_within(tokens, 2000, 30) == 1


def test_unpriced_pricing_never_binds() -> None:
    for pricing in (StepPricing(calibrated(), None, 10), StepPricing(StepCostModel(), 0.1, 10)):
        assert not pricing.priced() and pricing.time_left_s() == float("inf")
        assert pricing.largest_chunk(500, 4000) == 500 and pricing.layers_within(500, 4000, 10) == 10


def test_a_chunk_whose_layers_all_fit_stays_within_the_token_budget() -> None:
    """A short chunk is mostly overhead, so step 2 weighs a layered chunk instead; when all of its
    layers fit the time it runs as an ordinary chunk, and then the budget left bounds it (a layered
    chunk runs in a forward of its own; an ordinary one shares the step's rows)."""
    pricing = StepPricing(calibrated(), 1.0, num_layers=4)  # time for everything
    plan = StepPlan(budget=2, partial_slots=1, long_slots=1, pricing=pricing)
    assert pricing.chunk_overhead_share(2, 0) > MAX_CHUNK_OVERHEAD  # the layered path is weighed
    chunk = choose_chunk(plan, rest=4, num_computed=0, mid_prefill=False, num_layers=4, max_chunk_tokens=32,
                         block_size=4)  # fmt: skip
    assert chunk == ChunkPlan(2)


def test_a_shape_counts_and_sums_every_field_in_order() -> None:
    """counts() and + are spelled out for speed: they must follow the fields as declared."""
    names = [f.name for f in dataclasses.fields(StepShape)]
    shape = StepShape(**{name: float(i + 1) for i, name in enumerate(names)})
    assert shape.counts() == tuple(float(i + 1) for i in range(len(names)))
    assert (shape + shape).counts() == tuple(2.0 * (i + 1) for i in range(len(names)))
