"""StepCostModel: a least-squares fit of step time over tokens, inverted for a token budget."""

from __future__ import annotations

import random

import pytest

from servelm.scheduler.step_cost import StepCostModel


def test_no_answer_before_the_window_can_separate_fixed_from_per_token_cost() -> None:
    model = StepCostModel()
    assert model.tokens_within(0.1) is None
    for _ in range(10):
        model.observe(32, 0.02)  # all steps the same size: no slope
    assert model.fit() is None and model.tokens_within(0.1) is None


def test_recovers_a_linear_cost_and_inverts_it() -> None:
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(40):
        tokens = rng.randint(1, 2048)
        model.observe(tokens, 0.010 + 0.0005 * tokens)  # 10 ms fixed, 0.5 ms per token
    fixed, per_token = model.fit()
    assert fixed == pytest.approx(0.010, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)
    assert model.tokens_within(0.110) == 200
    assert model.tokens_within(0.005) == 0  # under the fixed part: nothing fits


def test_follows_the_machine_through_its_window() -> None:
    model = StepCostModel(window=16)
    for tokens in range(1, 17):
        model.observe(tokens * 10, 0.001 * tokens * 10)  # 1 ms per token
    for tokens in range(1, 17):
        model.observe(tokens * 10, 0.004 * tokens * 10)  # the machine got 4x slower
    assert model.fit()[1] == pytest.approx(0.004)


def test_noise_with_no_upward_slope_gives_no_budget() -> None:
    model = StepCostModel()
    for tokens, seconds in ((10, 0.05), (100, 0.04), (200, 0.03), (400, 0.02)):
        model.observe(tokens, seconds)
    assert model.tokens_within(1.0) is None


def test_ignores_empty_steps() -> None:
    model = StepCostModel()
    model.observe(0, 0.01)
    model.observe(10, 0.0)
    assert model.fit() is None


def test_keeps_its_last_fit_when_the_window_holds_only_one_step_size() -> None:
    # Steps shaped by the budget all have about one size: no new slope, but the old one holds.
    model = StepCostModel(window=8)
    for tokens in (1, 10, 50, 100):
        model.observe(tokens, 0.010 + 0.001 * tokens)
    assert model.tokens_within(0.050) == 40
    for _ in range(8):
        model.observe(41, 0.051)
    assert model.fit() is None
    assert model.tokens_within(0.050) == 40


def test_a_fixed_share_floor_keeps_steps_from_shrinking_to_their_fixed_part() -> None:
    model = StepCostModel()
    for tokens in (1, 8, 32, 64, 128):
        model.observe(tokens, 0.030 + 0.001 * tokens)  # 30 ms fixed, 1 ms a token
    assert model.tokens_within(0.020) == 0  # even the fixed part is over 20 ms
    assert model.tokens_within(0.020, max_fixed_share=0.25) == 90  # 30 ms is a quarter of 30 + 90
    assert model.tokens_within(0.200, max_fixed_share=0.25) == 170  # over the floor: the bound itself
