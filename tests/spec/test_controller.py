"""SpecController: k per request from measured acceptance and step cost, on synthetic curves.

Acceptance is either taught exactly (a verification of n drafts with n - 1 accepted is n - 1
successes and one failure: acceptance (n - 1) / n) or drawn from a seeded geometric process, the
way a real proposer's drafts meet the target's samples.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.spec.controller import PROBE_EVERY, PROBE_TIME_SHARE, DraftOffer, SpecController, StepCost

CPU_COST = StepCost(fixed_s=0.03, per_token_s=0.004)  # about the default model's decode on this CPU
MAX_K = 5


def teach(controller: SpecController, request_id: str, num_drafted: int, times: int = 60) -> None:
    """Acceptance (num_drafted - 1) / num_drafted, exactly: every verification rejects the last draft."""
    for _ in range(times):
        controller.observe(request_id, num_drafted, num_drafted - 1)


def offers(request_ids: list[str], num_available: int = MAX_K) -> list[DraftOffer]:
    return [DraftOffer(request_id, num_available) for request_id in request_ids]


def batch_ks(num_drafted: int, batch_size: int, cost: StepCost | None) -> list[int]:
    """k for every request of a fresh controller's batch, all taught the same acceptance."""
    controller = SpecController(MAX_K)
    ids = [f"r{i}" for i in range(batch_size)]
    for request_id in ids:
        teach(controller, request_id, num_drafted)
    ks = controller.choose(offers(ids), batch_size, cost)
    return [ks[request_id] for request_id in ids]


def simulate(
    acceptance: Callable[[int, str], float], batch_size: int, num_steps: int, seed: int, cost: StepCost = CPU_COST
) -> dict[str, list[int]]:
    """k per request per step, each verification accepting drafts in order with probability
    acceptance(step, request_id) until the first rejection."""
    rng = random.Random(seed)
    controller = SpecController(MAX_K)
    history: dict[str, list[int]] = {f"r{i}": [] for i in range(batch_size)}
    for step in range(num_steps):
        ks = controller.choose(offers(list(history)), batch_size, cost)
        for request_id, k in ks.items():
            history[request_id].append(k)
            num_accepted = 0
            while num_accepted < k and rng.random() < acceptance(step, request_id):
                num_accepted += 1
            controller.observe(request_id, k, num_accepted)
    return history


def runs(ks: list[int]) -> list[int]:
    """Lengths of the runs of equal k."""
    lengths = [1]
    for before, after in zip(ks, ks[1:]):
        if before == after:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def test_high_acceptance_and_cheap_extra_tokens_verify_every_draft() -> None:
    cheap = StepCost(fixed_s=0.03, per_token_s=0.0001)
    assert batch_ks(20, 1, cheap) == [MAX_K]  # acceptance 0.95
    assert batch_ks(20, 8, cheap) == [MAX_K] * 8
    assert batch_ks(20, 1, CPU_COST) == [MAX_K]


def test_k_falls_to_zero_as_extra_tokens_get_dearer() -> None:
    ks = [batch_ks(5, 1, StepCost(0.03, 0.03 * ratio)) for ratio in (0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 3, 10)]
    flat = [k for (k,) in ks]
    assert flat[0] == MAX_K and flat[-1] == 0
    assert flat == sorted(flat, reverse=True), flat


def test_k_fades_out_as_the_batch_grows_without_a_cliff() -> None:
    for num_drafted in (2, 3, 10):  # acceptance 0.5, 0.67, 0.9
        mean_ks = [sum(ks) / len(ks) for ks in (batch_ks(num_drafted, b, CPU_COST) for b in range(1, 97))]
        assert mean_ks == sorted(mean_ks, reverse=True), mean_ks
        assert mean_ks[-1] == 0
        # one more request in the batch takes at most one draft from each request on average
        assert all(before - after <= 1.0 for before, after in zip(mean_ks, mean_ks[1:])), mean_ks


def test_a_draft_models_own_forwards_are_charged() -> None:
    """Acceptance 0.5 pays when drafts cost only their verification (a lookup), and stops paying
    as each draft's making (a draft model's forward) approaches a step's cost."""
    free = StepCost(0.03, 0.0005)
    ks = [batch_ks(2, 1, StepCost(free.fixed_s, free.per_token_s, draft_token_s=s)) for s in (0.0, 0.002, 0.01, 0.03)]
    flat = [k for (k,) in ks]
    assert flat[0] >= 3 and flat[-1] == 0
    assert flat == sorted(flat, reverse=True), flat

    # 4% acceptance (a poor self-speculative draft): it pays for free, not at a quarter of a step a draft
    def poor() -> SpecController:
        controller = SpecController(MAX_K)
        for i in range(500):
            controller.observe("poor", 1, 1 if i % 25 == 0 else 0)
        return controller

    assert poor().choose(offers(["poor"]), 1, free)["poor"] >= 1
    assert poor().choose(offers(["poor"]), 1, StepCost(0.03, 0.0005, draft_token_s=0.0075))["poor"] == 0


def test_low_acceptance_gets_no_drafts() -> None:
    controller = SpecController(MAX_K)
    for _ in range(60):
        controller.observe("low", 5, 0)  # acceptance ~0
    assert controller.choose(offers(["low"]), 1, CPU_COST) == {"low": 0}


def test_new_requests_start_at_the_running_average_of_all_requests() -> None:
    repetitive = SpecController(MAX_K)
    for i in range(10):
        teach(repetitive, f"old{i}", 20)  # everyone so far: acceptance 0.95
    assert repetitive.choose(offers(["new"]), 1, CPU_COST) == {"new": MAX_K}

    chatty = SpecController(MAX_K)
    for i in range(10):
        for _ in range(60):
            chatty.observe(f"old{i}", 5, 0)
    assert chatty.choose(offers(["new"]), 1, CPU_COST) == {"new": 0}


def test_forget_drops_what_a_request_taught_itself() -> None:
    controller = SpecController(MAX_K)
    for i in range(10):
        teach(controller, f"good{i}", 20)
    for _ in range(60):
        controller.observe("bad", 5, 0)
    assert controller.choose(offers(["bad"]), 1, CPU_COST) == {"bad": 0}
    controller.forget("bad")
    controller.forget("bad")  # safe twice
    assert controller.choose(offers(["bad"]), 1, CPU_COST) == {"bad": MAX_K}  # back at the average


def test_a_request_whose_text_turns_repetitive_gets_its_drafts_back() -> None:
    turn = 300

    def acceptance(step: int, request_id: str) -> float:
        return 0.95 if request_id == "r0" and step >= turn else 0.05

    for seed in range(4):
        ks = simulate(acceptance, batch_size=8, num_steps=turn + 100, seed=seed)["r0"]
        assert ks[turn - 100 : turn].count(0) >= 90, (seed, ks[turn - 100 : turn])  # held at 0 but for probes
        back = max(step for step in range(turn, turn + 100) if ks[step] == 0) + 1  # k >= 1 from here on
        assert back - turn <= 3 * PROBE_EVERY, (seed, ks[turn:])
        assert ks[-1] >= 3, (seed, ks[turn:])


@pytest.mark.parametrize("acceptance, batch_size", [(0.9, 1), (0.6, 1), (0.4, 1), (0.7, 4), (0.9, 8), (0.5, 2)])
def test_k_does_not_oscillate_in_a_constant_environment(acceptance: float, batch_size: int) -> None:
    for seed in range(3):
        history = simulate(lambda step, request_id: acceptance, batch_size, num_steps=250, seed=seed)
        for ks in history.values():
            settled = ks[50:]  # 200 steps after warm-up
            # k drifts with its estimate at most a few times, and never flips back and forth
            assert min(settled) >= 1 and len(runs(settled)) <= 4, (seed, settled)
            assert min(runs(settled)[1:-1], default=len(settled)) >= 10, (seed, settled)


def test_a_request_held_at_zero_only_probes() -> None:
    # acceptance 0.2 at batch 8 never pays: k stays 0 but for probes, one draft per PROBE_EVERY steps
    # (a longer probe only after an accepted one)
    history = simulate(lambda step, request_id: 0.2, batch_size=8, num_steps=400, seed=0)
    for ks in history.values():
        settled = ks[50:]
        assert settled.count(0) >= len(settled) * (1 - 2 / PROBE_EVERY), settled
        assert sum(settled) <= 2 * len(settled) / PROBE_EVERY, settled
    # at a batch where not even a sure draft pays, there are no probes at all
    large = simulate(lambda step, request_id: 0.2, batch_size=64, num_steps=100, seed=0)
    assert all(sum(ks[20:]) == 0 for ks in large.values())


def test_before_the_cost_fit_a_prior_speculates_only_at_small_batches() -> None:
    assert batch_ks(10, 1, None) == [MAX_K]  # acceptance 0.9
    assert batch_ks(10, 64, None) == [0] * 64


def test_fixed_k_when_not_adaptive() -> None:
    controller = SpecController(MAX_K, adaptive=False)
    for _ in range(60):
        controller.observe("r0", 5, 0)
    step = [DraftOffer("r0", 3), DraftOffer("r1", 5), DraftOffer("r2", 9)]
    for num_step_tokens, cost in ((3, CPU_COST), (500, CPU_COST), (3, None)):
        assert controller.choose(step, num_step_tokens, cost) == {"r0": 3, "r1": 5, "r2": 5}


@settings(derandomize=True, max_examples=150, deadline=None)
@given(
    max_k=st.integers(1, 16),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(1, 20), min_size=0, max_size=12),  # num_available per offer r0, r1, ...
            st.integers(0, 300),  # extra step tokens (prefill chunks, decodes without drafts)
            st.one_of(st.none(), st.tuples(st.floats(0, 0.1), st.floats(1e-6, 0.05))),
            st.integers(0, 2**31),  # seed of the acceptance draws and forgets
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_k_is_within_what_each_request_has(
    max_k: int, steps: list[tuple[list[int], int, tuple[float, float] | None, int]]
) -> None:
    controller = SpecController(max_k)
    for available, extra_tokens, fit, seed in steps:
        rng = random.Random(seed)
        step = [DraftOffer(f"r{i}", n) for i, n in enumerate(available)]
        cost = None if fit is None else StepCost(*fit)
        ks = controller.choose(step, len(step) + extra_tokens, cost)
        assert set(ks) == {offer.request_id for offer in step}
        for offer in step:
            k = ks[offer.request_id]
            assert 0 <= k <= offer.num_available
            controller.observe(offer.request_id, k, rng.randint(0, k))
            if rng.random() < 0.1:
                controller.forget(offer.request_id)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="max_k"):
        SpecController(0)
    controller = SpecController(MAX_K)
    with pytest.raises(ValueError, match="offered twice"):
        controller.choose(offers(["a", "a"]), 2, CPU_COST)
    with pytest.raises(ValueError, match="num_available"):
        controller.choose([DraftOffer("a", 0)], 1, CPU_COST)
    with pytest.raises(ValueError, match="num_step_tokens"):
        controller.choose(offers(["a", "b"]), 1, CPU_COST)
    with pytest.raises(ValueError, match="cost"):
        controller.choose(offers(["a"]), 1, StepCost(-1.0, 0.001))
    with pytest.raises(ValueError, match="num_accepted"):
        controller.observe("a", 2, 3)


def test_a_costly_proposer_probes_less_often() -> None:
    """Held at k = 0, a lookup proposer probes every PROBE_EVERY steps; a draft model whose draft
    costs half a step probes so rarely that its probes stay within PROBE_TIME_SHARE of the time."""
    costs = {"lookup": StepCost(0.03, 0.0005), "draft model": StepCost(0.03, 0.0005, draft_token_s=0.015)}
    probes = {}
    for name, cost in costs.items():
        controller = SpecController(MAX_K)
        for _ in range(60):
            controller.observe("r", 5, 0)
        ks = [controller.choose(offers(["r"]), 1, cost)["r"] for _ in range(400)]
        probes[name] = sum(1 for k in ks if k > 0)
    assert 400 // PROBE_EVERY - 1 <= probes["lookup"] <= 400 // PROBE_EVERY + 1
    assert probes["draft model"] * 0.015 <= PROBE_TIME_SHARE * 0.0305 * 400 + 0.015
    assert probes["draft model"] >= 1


def test_a_new_request_is_judged_by_the_global_acceptance_before_its_first_drafts() -> None:
    """A prompt's first drafts are made before the controller has seen the request: as many as the
    global acceptance pays at the last step's size, none when that pays nothing (then it waits for
    its first probe like a request held at k = 0); all of them before any step has chosen."""
    fresh = SpecController(MAX_K)
    assert fresh.drafts_wanted("new") == MAX_K
    good = SpecController(MAX_K)
    teach(good, "old", 10)  # acceptance 0.9
    good.choose(offers(["old"]), 1, CPU_COST)
    assert good.drafts_wanted("new") > 0
    poor = SpecController(MAX_K)
    for _ in range(60):
        poor.observe("old", 5, 0)
    poor.choose(offers(["old"]), 1, CPU_COST)
    assert poor.drafts_wanted("new") == 0
    for _ in range(PROBE_EVERY):
        poor.decoded_without_drafts("new")
    assert poor.drafts_wanted("new") == 1  # its first probe


def test_no_probe_drafts_are_made_while_no_probe_would_pay_and_a_due_probe_is_verified() -> None:
    controller = SpecController(MAX_K)
    for _ in range(60):
        controller.observe("r", 5, 0)
    controller.choose(offers(["r"]), 64, CPU_COST)  # a batch where not even a sure draft pays
    for _ in range(3 * PROBE_EVERY):
        controller.decoded_without_drafts("r")
        assert controller.drafts_wanted("r") == 0
    controller.choose([], 1, CPU_COST)  # the batch shrank (a step with no drafts on offer still counts)
    assert controller.drafts_wanted("r") == 1
    # its probe's drafts were made: they are verified though the interval grew meanwhile
    dearer = StepCost(CPU_COST.fixed_s, CPU_COST.per_token_s, draft_token_s=0.005)  # probes every ~27 steps
    assert controller.choose(offers(["r"], 1), 1, dearer) == {"r": 1}
