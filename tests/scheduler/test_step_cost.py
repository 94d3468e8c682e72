"""StepCostModel: a least-squares fit of step time over tokens, inverted for a token budget."""

from __future__ import annotations

import random

import pytest

from servelm.scheduler.step_cost import StepCostModel, chunk_pairs


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


def _chunked_cost(tokens: int, context: int) -> float:
    """10 ms fixed, 0.5 ms a token, 1 µs an attention pair."""
    return 0.010 + 0.0005 * tokens + 1e-6 * chunk_pairs(tokens, context)


def test_recovers_the_attention_cost_of_chunks_deep_in_a_prompt() -> None:
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(40):
        tokens, context = rng.randint(1, 512), rng.choice((0, 0, 500, 1500, 3000))
        model.observe(tokens, _chunked_cost(tokens, context), chunk_pairs(tokens, context))
    fixed, per_token = model.fit()
    assert fixed == pytest.approx(0.010, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)
    assert model.per_pair_s == pytest.approx(1e-6, rel=1e-6)
    assert model.tokens_within(0.110) == 200  # tokens without pairs (decodes): as before
    for context in (0, 1000, 3000):
        n = model.tokens_within(0.110, context=context)
        assert _chunked_cost(n, context) <= 0.110 < _chunked_cost(n + 1, context), context
    assert model.tokens_within(0.110, context=3000) == 28  # ~0.0035 s a token at that depth


def test_prices_prompt_blocks_by_their_tokens_and_their_pairs_at_depth_without_the_fixed_part() -> None:
    model = StepCostModel()
    assert model.prompt_blocks_s(16, 0, 3) is None  # no fit yet
    rng = random.Random(2)
    for _ in range(40):
        tokens, context = rng.randint(1, 512), rng.choice((0, 0, 500, 1500, 3000))
        model.observe(tokens, _chunked_cost(tokens, context), chunk_pairs(tokens, context))
    blocks = model.prompt_blocks_s(16, 2048, 3)
    assert blocks is not None and len(blocks) == 3
    for i, seconds in enumerate(blocks):
        depth = 2048 + 16 * i
        assert seconds == pytest.approx(_chunked_cost(16, depth) - 0.010, rel=1e-6)
    assert blocks[0] < blocks[1] < blocks[2]  # deeper blocks attend to more of the prompt


def test_a_window_without_chunks_keeps_the_pair_cost_and_nets_it_out() -> None:
    model = StepCostModel(window=16)
    for tokens, context in [(t, c) for t in (16, 64, 128, 256) for c in (0, 2000)]:
        model.observe(tokens, _chunked_cost(tokens, context), chunk_pairs(tokens, context))
    assert model.fit() is not None and model.per_pair_s == pytest.approx(1e-6, rel=1e-6)
    for tokens in (1, 4, 8, 16, 2, 6, 12, 3) * 2:  # decodes only, now twice as slow per token
        model.observe(tokens, 0.010 + 0.001 * tokens)
    fixed, per_token = model.fit()
    assert per_token == pytest.approx(0.001, rel=1e-6) and model.per_pair_s == pytest.approx(1e-6, rel=1e-6)
    # A mixed window whose pairs only follow its tokens (every chunk at the same depth) cannot
    # tell them apart: the known pair cost is taken off and the tokens fitted to the rest.
    model = StepCostModel(window=16)
    for tokens, context in [(t, c) for t in (16, 64, 128, 256) for c in (0, 2000)]:
        model.observe(tokens, _chunked_cost(tokens, context), chunk_pairs(tokens, context))
    assert model.fit() is not None  # the scheduler asks every step: the pair cost is learned here
    for tokens in (10, 20, 30, 40) * 4:
        model.observe(tokens, 0.010 + 0.0005 * tokens + 1e-6 * tokens * 1000, tokens * 1000)
    fixed, per_token = model.fit()
    assert fixed == pytest.approx(0.010, abs=1e-9) and per_token == pytest.approx(0.0005, rel=1e-6)
