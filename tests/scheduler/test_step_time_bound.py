"""The step-time bound (step_pricing.py) and layered prefill in the scheduler, driven by hand-built
ModelOutputs over a cost model taught an exact linear truth: every step is held to the target,
decodes or not; a request arriving mid-prefill joins the next step (decodes, short prompts, then
the long prompt's chunk); a chunk the target would make too small runs by layers instead, its
tokens computed only after its last layer."""

from __future__ import annotations

import pytest
from test_scheduler import EOS, Clock, make_scheduler, request, step

from servelm.config import SchedulerConfig
from servelm.kv import KVCacheManager
from servelm.scheduler.request import RequestStatus
from servelm.scheduler.scheduler import Scheduler
from servelm.scheduler.step_cost import StepShape
from servelm.scheduler.step_pricing import (
    AUTO_TARGET_FACTOR,
    FINISH_COST_SHARE,
    FINISH_SLOWDOWN,
    FIRST_TOKEN_SHARE,
    LONE_LAYER_SHARE,
    finishing_slowdown,
)

# Seconds per unit of (fixed, dense pass, decode token, decode context, prompt token, pair, chunk context).
TRUTH = (0.002, 0.008, 0.001, 0.0, 0.0005, 1e-6, 1e-5)
NUM_LAYERS = 10


def truth_s(shape: StepShape) -> float:
    return sum(c * x for c, x in zip(TRUTH, shape.features()))


def calibrated(s: Scheduler) -> Scheduler:
    """`s` with its cost model calibrated on TRUTH, as the engine builder calibrates it at start-up."""
    shapes = [StepShape(dense_passes=1) + StepShape.chunk(n, 0) for n in (16, 64, 256)]
    shapes += [StepShape(dense_passes=0.1) + StepShape.chunk(n, d, 0.1) for n, d in ((128, 1024), (256, 2048), (32, 4096))]
    shapes += [StepShape.decode(1, d) for d in (16, 1024, 4096)] + [StepShape.decode(4, 16) + StepShape.decode(1, 0)]
    s.step_cost.calibrate([(shape, truth_s(shape)) for shape in shapes])
    return s


def bounded(max_step_ms: float | None = 100.0, num_layers: int = NUM_LAYERS, **config: object) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 2048)
    config.setdefault("max_model_len", 8192)
    config.setdefault("aging_s", 0.0)
    kv = KVCacheManager(4096, 4)
    return calibrated(Scheduler(SchedulerConfig(max_step_ms=max_step_ms, **config), kv, eos_token_ids=[EOS],  # type: ignore[arg-type]
                                clock=Clock(), num_layers=num_layers))  # fmt: skip


def planned_s(s: Scheduler, so) -> float:
    shape, _ = s.executed_shape(so)
    return truth_s(shape)


def run_step(s: Scheduler):
    so = s.schedule()
    s.check_invariants()
    seconds = planned_s(s, so)
    from test_scheduler import sample_for

    model_output = sample_for(s, so)
    model_output.execute_seconds = seconds
    outputs = {o.request_id: o for o in s.update(so, model_output)}
    s.check_invariants()
    return so, outputs, seconds


def test_the_default_target_prices_what_chunking_repeats_on_this_engine() -> None:
    # Layered prefill: a chunk's pass over the weights is shared by the NUM_LAYERS x LONE_LAYER_SHARE
    # targets' worth of steps it spans; token chunks only: every step pays one.
    s = bounded(max_step_ms=None)
    repeated = TRUTH[0] + TRUTH[1] / (NUM_LAYERS * LONE_LAYER_SHARE)
    assert s.step_target_s() == pytest.approx(AUTO_TARGET_FACTOR * repeated, rel=1e-3)
    token_chunks = bounded(max_step_ms=None, layered_prefill=False)
    assert token_chunks.step_target_s() == pytest.approx(AUTO_TARGET_FACTOR * (TRUTH[0] + TRUTH[1]), rel=1e-3)
    assert bounded(max_step_ms=0.0).step_target_s() is None
    assert bounded(max_step_ms=250.0).step_target_s() == pytest.approx(0.25)
    uncalibrated = make_scheduler(max_step_ms=None)
    assert uncalibrated.step_target_s() is None  # nothing measured: no default to derive


def test_a_lone_long_prompt_is_held_to_the_target_and_runs_its_deep_chunks_by_layers() -> None:
    """Nothing else runs, yet every step ends within the target: whatever arrives next waits at
    most that. Shallow, token chunks are efficient; deep, a token chunk that fits would be mostly
    its context re-read, and the chunk runs a few layers a step instead."""
    s = bounded()
    s.add_request(request("long", 6000, max_tokens=1))
    layered_steps = token_steps = 0
    while (r := s.get_request("long")) is not None and r.num_output_tokens == 0:
        computed_before = r.num_computed_tokens
        so, out, seconds = run_step(s)
        assert seconds <= 0.100 + 1e-9, so
        if so.layer_slices:
            layered_steps += 1
            layers = so.layer_slices["long"]
            done = layers.end_layer == NUM_LAYERS
            assert ("long" in so.num_scheduled_tokens) == done  # its tokens count once its last layer ran
            assert r.num_computed_tokens == computed_before + (layers.num_tokens if done else 0)
        else:
            token_steps += 1
    assert token_steps > 0 and layered_steps > 0
    assert out["long"].new_token_ids and out["long"].num_prompt_tokens == 6000


def test_without_layered_prefill_deep_chunks_are_small_token_chunks_within_the_target() -> None:
    s = bounded(num_layers=0)
    s.add_request(request("long", 3000, max_tokens=1))
    sizes = []
    while s.get_request("long") is not None:
        so, _, seconds = run_step(s)
        assert not so.layer_slices and seconds <= 0.100 + 1e-9
        sizes.append(so.num_scheduled_tokens.get("long", 0))
    assert sizes[0] > 4 * sizes[-2]  # deep chunks shrink with their context


def test_a_short_request_arriving_mid_prefill_joins_the_next_step_ahead_of_the_long_chunk() -> None:
    s = bounded()
    s.add_request(request("long", 6000, max_tokens=1))
    long = s.get_request("long")
    for _ in range(400):  # well into the prompt, a layered chunk in flight
        run_step(s)
        if long.num_computed_tokens >= 1024 and long.layered_tokens > 0:
            break
    assert long.layered_tokens > 0
    s.add_request(request("short", 16, max_tokens=4))
    so, out, seconds = run_step(s)
    assert so.num_scheduled_tokens.get("short") == 16 and out["short"].new_token_ids  # whole, first token now
    # The step that gives a first token ends within FIRST_TOKEN_SHARE of the target; the long
    # prompt still moves in it if a layer fits.
    assert seconds <= FIRST_TOKEN_SHARE * 0.100 + 1e-9
    so, out, seconds = run_step(s)
    assert so.num_scheduled_tokens["short"] == 1 and "long" in so.layer_slices and seconds <= 0.100 + 1e-9


def test_shorts_go_first_within_a_priority_and_not_across_priorities() -> None:
    s = bounded()
    s.add_request(request("long", 3000, max_tokens=1, priority=0))
    run_step(s)
    s.add_request(request("batch-short", 16, max_tokens=1, priority=1))
    s.add_request(request("short", 16, max_tokens=1, priority=0))
    so, _, _ = run_step(s)
    order = list(so.num_scheduled_tokens) + [rid for rid in so.layer_slices if rid not in so.num_scheduled_tokens]
    assert order.index("short") < order.index("long")
    # A short prompt of a worse priority waits for the long one's chunk: if it fits at all, after it.
    if "batch-short" in order:
        assert order.index("long") < order.index("batch-short")


def test_decodes_are_never_cut_and_a_long_prompt_still_moves_when_they_fill_the_step() -> None:
    s = bounded(max_step_ms=5.0)  # under even a decode step's fixed part
    for name in ("a", "b"):
        s.add_request(request(name, 8, max_tokens=50))
    while any(s.get_request(name).num_output_tokens == 0 for name in ("a", "b")):
        run_step(s)  # their prompts a block a step: even those are over 5 ms
    s.add_request(request("long", 2000, max_tokens=1))
    for _ in range(5):
        so, _, _ = run_step(s)
        assert so.num_scheduled_tokens["a"] == 1 and so.num_scheduled_tokens["b"] == 1
        assert "long" in so.num_scheduled_tokens or "long" in so.layer_slices  # a block or a layer a step


def test_a_layered_chunk_is_dropped_by_preemption_and_recomputed() -> None:
    s = bounded()
    s.add_request(request("long", 6000, max_tokens=1))
    while not s.get_request("long").layers_done:
        run_step(s)
    r = s.get_request("long")
    computed = r.num_computed_tokens
    plan_so = s.schedule()
    s.requeue_step(plan_so)  # the engine's recovery path: everything in the step goes back to waiting
    assert r.status is RequestStatus.PREEMPTED and r.layered_tokens == 0 and r.layers_done == 0
    assert r.num_computed_tokens == 0 and computed > 0
    so, _, _ = run_step(s)
    assert "long" in so.preempted_request_ids or "long" in {n.request_id for n in so.new_requests}
    s.check_invariants()


def test_an_aborted_layered_chunk_is_forgotten_by_the_runner() -> None:
    s = bounded()
    s.add_request(request("long", 6000, max_tokens=1))
    while not s.get_request("long").layers_done:
        run_step(s)
    s.abort_requests(["long"])
    so, out, _ = run_step(s)
    assert "long" in so.finished_request_ids and out["long"].finish_reason is not None
    assert not so.layer_slices


def test_unpriced_steps_keep_the_static_budget() -> None:
    for scheduler in (bounded(max_step_ms=0.0), make_scheduler(num_blocks=256, max_num_batched_tokens=64, max_model_len=512,
                                                               max_step_ms=None)):  # fmt: skip
        scheduler.add_request(request("long", 200))
        so, _ = step(scheduler)
        assert so.num_scheduled_tokens == {"long": min(200, scheduler.config.max_num_batched_tokens)}
        assert not so.layer_slices


def test_prediction_errors_are_logged_by_kind() -> None:
    s = bounded()
    s.add_request(request("long", 3000, max_tokens=2))
    while s.get_request("long") is not None:
        run_step(s)
    kinds = {kind for kind, predicted, measured in s.step_log.take_predictions()
             if predicted == pytest.approx(measured, rel=1e-6)}  # fmt: skip
    assert kinds == {"shallow", "deep", "decode"}


def streams_then_a_long_prompt(max_decode_slowdown: float, stream_priority: int = 0) -> Scheduler:
    """Streams "a" and "b" decoding (of `stream_priority`), then a 3,000-token prompt of priority 0
    arrives; 100 ms target."""
    s = bounded(max_step_ms=100.0, max_decode_slowdown=max_decode_slowdown)
    for name in ("a", "b"):
        s.add_request(request(name, 8, max_tokens=200, priority=stream_priority))
    while any(s.get_request(name).num_output_tokens == 0 for name in ("a", "b")):
        run_step(s)
    s.add_request(request("long", 3000, max_tokens=1, priority=0))
    return s


def test_while_streams_decode_a_prefill_step_is_held_to_the_decode_slowdown() -> None:
    """Two streams decode while a long prompt arrives: every step holds their decodes and at most
    max_decode_slowdown x what those decodes alone take, however much of the target is left, and the
    long prompt still moves every step (by layers: a token chunk's pass would not fit)."""
    s = streams_then_a_long_prompt(max_decode_slowdown=2.5)
    for _ in range(20):
        decodes_alone = truth_s(sum((StepShape.decode(1, s.get_request(n).num_computed_tokens) for n in "ab"),
                                    StepShape()))  # fmt: skip
        so, _, seconds = run_step(s)
        assert so.num_scheduled_tokens["a"] == so.num_scheduled_tokens["b"] == 1
        assert "long" in so.num_scheduled_tokens or "long" in so.layer_slices
        assert seconds <= 2.5 * decodes_alone + 1e-9, (seconds, decodes_alone)
    # Without the pace bound the same steps fill the 100 ms target.
    unpaced = streams_then_a_long_prompt(max_decode_slowdown=0.0)
    assert max(run_step(unpaced)[2] for _ in range(5)) > 0.05


def decodes_alone_s(s: Scheduler, names: tuple[str, ...]) -> float:
    return truth_s(sum((StepShape.decode(1, s.get_request(n).num_computed_tokens) for n in names), StepShape()))


def test_a_stream_near_its_end_is_paced_tighter_beside_a_prompt_with_far_to_go() -> None:
    """A short request (8 tokens out) and a long stream start decoding beside a long prompt: while
    the short one's last tokens cost the prompt little, every step is held to FINISH_SLOWDOWN x
    the decodes alone (the prompt still moves each step); once it is done, the long stream alone is
    paced at max_decode_slowdown again: its hundreds of tokens would cost the prompt too much."""
    s = bounded(max_step_ms=100.0, max_decode_slowdown=2.5)
    s.add_request(request("long", 3000, max_tokens=1))
    run_step(s)
    s.add_request(request("short", 8, max_tokens=8))
    s.add_request(request("stream", 8, max_tokens=400))
    while any(s.get_request(n).num_output_tokens == 0 for n in ("short", "stream")):
        run_step(s)
    while s.get_request("short") is not None:
        alone = decodes_alone_s(s, ("short", "stream"))
        so, _, seconds = run_step(s)
        assert "long" in so.num_scheduled_tokens or "long" in so.layer_slices
        assert seconds <= FINISH_SLOWDOWN * alone + 1e-9, (seconds, alone)
    paces = []
    for _ in range(6):
        alone = decodes_alone_s(s, ("stream",))
        paces.append(run_step(s)[2] / alone)
    assert FINISH_SLOWDOWN + 0.3 < max(paces) <= 2.5 + 1e-9, paces


def test_the_finishing_pace_costs_the_quickest_prompt_at_most_its_share() -> None:
    """finishing_slowdown: FINISH_SLOWDOWN exactly while a stream's remaining steps at it cost the
    quickest prompt at most FINISH_COST_SHARE of its prefill time left."""
    s = bounded()
    decodes = StepShape.decode(1, 100)
    step_s = truth_s(decodes)
    for tokens_left in (1, 16, 200):
        break_even = tokens_left * (2.5 - FINISH_SLOWDOWN) * step_s / FINISH_COST_SHARE
        assert finishing_slowdown(s.step_cost, decodes, 2.5, tokens_left, [break_even * 1.01]) == FINISH_SLOWDOWN
        assert finishing_slowdown(s.step_cost, decodes, 2.5, tokens_left, [break_even * 0.99]) == 2.5
        # The quickest prompt decides, wherever it stands among them.
        assert finishing_slowdown(s.step_cost, decodes, 2.5, tokens_left, [break_even * 9, break_even * 0.99]) == 2.5
    assert finishing_slowdown(s.step_cost, decodes, 2.5, 1, []) == 2.5  # no prompt to take from
    assert finishing_slowdown(s.step_cost, decodes, 1.2, 1, [100.0]) == 1.2  # already tighter


def test_prompts_that_do_not_finish_whole_go_fewest_tokens_left_first() -> None:
    """Two long prompts of one class mid-prefill, then a medium one arrives that no step finishes
    whole either: it takes the step's prefill time first (it has the fewest tokens left), and
    finishes long before the prompts that came earlier."""
    s = bounded(max_step_ms=100.0)
    for name in ("first", "second"):
        s.add_request(request(name, 4000, max_tokens=1))
    run_step(s)
    s.add_request(request("medium", 600, max_tokens=1))
    so, _, _ = run_step(s)
    order = list(so.num_scheduled_tokens) + [rid for rid in so.layer_slices if rid not in so.num_scheduled_tokens]
    assert order[0] == "medium", order
    while s.get_request("medium") is not None:
        run_step(s)
    assert s.get_request("first").num_computed_tokens < 4000 and s.get_request("second") is not None


def test_a_longer_prompt_is_not_starved_by_shorter_ones_arriving_after_it() -> None:
    """Streams decode while 250-token prompts of one class arrive one after another behind a
    400-token one, about as fast as the steps prefill them, none finishing whole in a step. By wait
    per token left the 400-token prompt finishes after one of them (step 27); shortest-first (aging
    off, as here) kept it behind every 250-token prompt that came while it waited: 25 of them, 198
    steps, measured on this same setup."""
    s = bounded(max_step_ms=30.0, max_decode_slowdown=0)
    clock = s._clock
    for name in ("s1", "s2"):
        s.add_request(request(name, 8, max_tokens=4000))
    while s.get_request("s1").num_output_tokens == 0:
        run_step(s)
    s.add_request(request("old", 400, max_tokens=1, arrival_time=clock.now))
    finished: list[str] = []
    for step_index in range(400):
        if step_index % 8 == 0:  # a 250-token prompt every 8 steps: these steps take one in ~7
            s.add_request(request(f"new{step_index}", 250, max_tokens=1, arrival_time=clock.now))
        _, outputs, seconds = run_step(s)
        clock.now += seconds
        finished += [rid for rid, out in outputs.items() if out.finish_reason is not None and rid not in ("s1", "s2")]
        if "old" in finished:
            break
    assert "old" in finished and finished.index("old") <= 2, finished


def test_a_prompt_arriving_beside_a_deep_long_prompt_that_waited_is_not_held_for_its_whole_rest() -> None:
    """A 6,000-token prompt that waited 20 s and is halfway through; a 300-token prompt of its class
    arrives. Ranked by wait per second of work left, the newcomer is done 0.7 s later (3.5x its own
    prefill time). Ranked by wait per token left, the long prompt's last 3,000 tokens (its dearest:
    each attends over all before it) kept outranking it, the long one's ratio growing as its tokens
    left shrank: 3.8 s (18x), and in the simulated mixed profile a voice turn waited 11 s for a
    whole code prompt that way."""
    s = bounded(max_step_ms=30.0)
    clock = s._clock
    s.add_request(request("long", 6000, max_tokens=1, arrival_time=clock.now - 20.0))
    long = s.get_request("long")
    while long.num_computed_tokens < 3000:
        _, _, seconds = run_step(s)
        clock.now += seconds
    s.add_request(request("short", 300, max_tokens=1, arrival_time=clock.now))
    sent = clock.now
    own_s = truth_s(StepShape(dense_passes=1) + StepShape.chunk(300, 0))
    while s.get_request("short") is not None:
        _, _, seconds = run_step(s)
        clock.now += seconds
    assert s.get_request("long") is not None  # the newcomer did not wait for the whole long prompt
    assert clock.now - sent <= 10 * own_s, (clock.now - sent, own_s)


def test_a_worse_priority_stream_does_not_hold_back_a_better_prompt() -> None:
    """Batch streams (priority 1) decoding beside an interactive prompt (priority 0): their pace
    does not bound its steps (the target does); an interactive stream's would."""
    s = streams_then_a_long_prompt(max_decode_slowdown=2.5, stream_priority=1)
    steps = [run_step(s)[2] for _ in range(5)]
    decodes_alone = truth_s(StepShape.decode(1, 10) + StepShape.decode(1, 10))
    assert max(steps) > 2.5 * decodes_alone and max(steps) <= 0.100 + 1e-9


def test_a_chunk_sized_alone_starts_over_when_a_stream_decodes_beside_it() -> None:
    """A prompt alone gets the largest layers; a short request arrives, prefills and decodes: its
    steps are paced, the big layer does not fit, and the long prompt's chunk starts over at the
    size these steps take instead of holding every token gap at one big layer. Nothing is lost but
    that chunk's layers: the prompt completes."""
    s = bounded(max_step_ms=100.0, max_decode_slowdown=2.5)
    s.add_request(request("long", 6000, max_tokens=1))
    long = s.get_request("long")
    for _ in range(400):
        run_step(s)
        if long.num_computed_tokens >= 2048 and long.layered_tokens and long.layers_done:
            break
    assert long.layered_alone and long.layers_done < NUM_LAYERS
    big_chunk = long.layered_tokens
    s.add_request(request("short", 8, max_tokens=60))
    while s.get_request("short").num_output_tokens == 0:
        run_step(s)
    gaps = []
    for _ in range(20):
        decode_alone = truth_s(StepShape.decode(1, s.get_request("short").num_computed_tokens))
        so, _, seconds = run_step(s)
        gaps.append((seconds, decode_alone))
    assert long.layered_tokens != big_chunk or not long.layered_alone  # started over
    assert all(seconds <= 2.5 * alone + 1e-9 for seconds, alone in gaps[1:]), gaps
    while s.get_request("long") is not None:
        run_step(s)
