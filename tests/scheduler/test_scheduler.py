"""Scheduler driven by hand-built ModelOutputs (no model): exact token counts, blocks, order."""

from __future__ import annotations

import pytest

from servelm.config import CacheConfig, SchedulerConfig
from servelm.datatypes import (
    EngineOutput,
    EngineRequest,
    EventType,
    FinishReason,
    ModelOutput,
    PositionLogprobs,
    RequestSlo,
    SchedulerOutput,
    TokenLogprob,
)
from servelm.kv import KVCacheManager
from servelm.sampling_params import SamplingParams
from servelm.scheduler.request import RequestStatus
from servelm.scheduler.scheduler import Scheduler

EOS = 2
TOKEN = 7  # what the fake model samples unless told otherwise


class Clock:
    """A settable wall clock, so aging and event times are exact."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    clock: Clock | None = None,
    prefix_caching: bool = True,
    **config: object,
) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", 64)
    config.setdefault("aging_s", 0.0)
    config.setdefault("max_step_ms", 0.0)  # the unit tests that want a step-time target set it
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(**config), kv, eos_token_ids=[EOS], clock=clock or Clock())  # type: ignore[arg-type]


def request(
    request_id: str,
    prompt: list[int] | int,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: object,
) -> EngineRequest:
    params.setdefault("max_tokens", 16)
    # An int asks for that many tokens no other request shares (no accidental prefix hits).
    base = 1000 * (1 + sum(map(ord, request_id)))
    prompt_ids = [base + i for i in range(prompt)] if isinstance(prompt, int) else prompt
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling_params=SamplingParams(temperature=0.0, **params),  # type: ignore[arg-type]
        priority=priority,
        arrival_time=arrival_time,
    )


def sample_for(scheduler: Scheduler, so: SchedulerOutput, tokens: dict[str, int] | None = None) -> ModelOutput:
    """What a runner returns: one token for each request this step caught up, else []."""
    sampled: dict[str, list[int]] = {}
    for request_id, num in so.num_scheduled_tokens.items():
        r = scheduler.get_request(request_id)
        assert r is not None
        caught_up = r.num_computed_tokens + num == r.num_tokens
        sampled[request_id] = [(tokens or {}).get(request_id, TOKEN)] if caught_up else []
    return ModelOutput(sampled_token_ids=sampled)


def step(
    scheduler: Scheduler, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, dict[str, EngineOutput]]:
    so = scheduler.schedule()
    scheduler.check_invariants()
    outputs = scheduler.update(so, sample_for(scheduler, so, tokens))
    scheduler.check_invariants()
    return so, {o.request_id: o for o in outputs}


def event_types(output: EngineOutput) -> list[EventType]:
    return [e.type for e in output.events]


# -- ordering and chunking ---------------------------------------------------------------


def test_decode_first_then_chunked_prefill_under_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(request("a", 6))
    so, out = step(s)
    assert so.num_scheduled_tokens == {"a": 6} and out["a"].new_token_ids == [TOKEN]
    assert event_types(out["a"]) == [
        EventType.ARRIVED, EventType.QUEUED, EventType.SCHEDULED, EventType.PREFILL_CHUNK, EventType.FIRST_TOKEN
    ]
    s.add_request(request("b", 20))
    so, out = step(s)
    # The decode goes first and takes 1; the new prompt gets the other 9 as a chunk.
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    assert [c.request_id for c in so.cached_requests] == ["a"]
    assert so.cached_requests[0].new_token_ids == [TOKEN]  # sampled last step, unseen by the runner
    assert so.cached_requests[0].num_computed_tokens == 6
    (new_b,) = so.new_requests
    assert new_b.num_computed_tokens == 0 and len(new_b.block_ids) == 3  # ceil(9 / 4)
    assert "b" not in out  # mid-prefill: nothing sampled, no output
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [c.new_token_ids for c in so.cached_requests] == [[TOKEN], []]
    so, out = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}
    assert out["b"].new_token_ids == [TOKEN] and out["b"].num_prompt_tokens == 20
    chunks = [e.detail for e in out["b"].events if e.type is EventType.PREFILL_CHUNK]
    assert chunks == [9, 9, 2]


def test_several_prompts_mid_prefill_at_once() -> None:
    s = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6, max_long_partial_prefills=3)
    for rid in ("p1", "p2", "p3"):
        s.add_request(request(rid, 10))
    so, out = step(s)
    assert so.num_scheduled_tokens == {"p1": 6, "p2": 6, "p3": 4} and out == {}
    assert all(s.get_request(r).num_computed_tokens == n for r, n in so.num_scheduled_tokens.items())
    so, out = step(s)
    assert so.num_scheduled_tokens == {"p1": 4, "p2": 4, "p3": 6}
    assert sorted(out) == ["p1", "p2", "p3"]


def test_max_num_seqs_bounds_running() -> None:
    s = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add_request(request(rid, 3))
    so, _ = step(s)
    assert sorted(so.num_scheduled_tokens) == ["a", "b"]
    assert s.num_running == 2 and s.num_waiting == 1


def test_a_request_counts_as_having_waited_from_its_arrival() -> None:
    """What admission counts as queued (num_waited_for): waiting requests older than the cut, in
    whatever group or tenant they wait; a running request never counts."""
    clock = Clock(1000.0)
    s = make_scheduler(max_num_seqs=1, clock=clock)
    s.add_request(request("oldest", 3, arrival_time=990.0))
    s.add_request(request("old", 3, arrival_time=999.0))
    s.add_request(request("old-urgent", 3, priority=-1, arrival_time=999.2))
    s.add_request(request("fresh", 3, arrival_time=999.9))
    step(s)  # the one seat goes to priority -1: "oldest", "old" and "fresh" wait
    assert s.num_running == 1 and s.num_waiting == 3
    assert [s.num_waited_for(t) for t in (0.05, 0.5, 0.9, 5.0, 20.0)] == [3, 2, 2, 1, 0]
    clock.now += 1.0
    assert s.num_waited_for(0.5) == 3


def test_unchunked_prompt_waits_for_a_whole_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add_request(request("a", 60))
    s.add_request(request("b", 10))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 60}  # b does not fit the 4 tokens left: not chunked
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}


# -- prefix cache ------------------------------------------------------------------------


def test_prefix_hit_raises_num_computed_tokens() -> None:
    s = make_scheduler()
    prompt = list(range(100, 110))
    s.add_request(request("a", prompt, max_tokens=1))
    step(s)
    assert not s.has_unfinished_requests()
    s.add_request(request("b", prompt[:8] + [1, 2, 3]))
    so, out = step(s)
    (new_b,) = so.new_requests
    assert new_b.num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 3}
    assert new_b.block_ids[:2] == [0, 1]  # a's cached blocks
    assert out["b"].num_cached_tokens == 8
    assert s.prefix_cache_stats.num_hit_tokens == 8


def test_whole_prompt_cached_keeps_last_token_uncomputed() -> None:
    s = make_scheduler()
    prompt = list(range(100, 108))  # exactly two blocks
    s.add_request(request("a", prompt, max_tokens=1))
    step(s)
    s.add_request(request("b", prompt))
    so, out = step(s)
    assert so.new_requests[0].num_computed_tokens == 4  # the last block is recomputed for logits
    assert so.num_scheduled_tokens == {"b": 4} and out["b"].new_token_ids == [TOKEN]


def test_prompt_logprobs_bypass_the_prefix_cache_and_arrive_with_the_first_token() -> None:
    s = make_scheduler(max_num_batched_tokens=5)
    prompt = list(range(100, 108))
    s.add_request(request("a", prompt, max_tokens=1))
    step(s)
    step(s)
    s.add_request(request("b", prompt, prompt_logprobs=0, max_tokens=2))

    def entries(start: int, end: int) -> list[PositionLogprobs | None]:
        lp = [PositionLogprobs(TokenLogprob(prompt[i], -1.0, 1), []) for i in range(max(1, start), end)]
        return ([None] if start == 0 else []) + lp  # type: ignore[return-value]

    so = s.schedule()
    assert so.new_requests[0].num_computed_tokens == 0 and so.num_scheduled_tokens == {"b": 5}
    assert s.update(so, ModelOutput({"b": []}, prompt_logprobs={"b": entries(0, 6)})) == []
    so = s.schedule()
    (out,) = s.update(so, ModelOutput({"b": [TOKEN]}, prompt_logprobs={"b": entries(6, 8)}))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 8
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[7].chosen.token_id == prompt[7]


def test_logprobs_pass_through() -> None:
    s = make_scheduler()
    s.add_request(request("a", 3, logprobs=1))
    so = s.schedule()
    lp = PositionLogprobs(TokenLogprob(TOKEN, -0.5, 1), [TokenLogprob(TOKEN, -0.5, 1)])
    (out,) = s.update(so, ModelOutput({"a": [TOKEN]}, logprobs={"a": [lp]}))
    assert out.new_logprobs == [lp]


# -- preemption --------------------------------------------------------------------------


def fill_three(s: Scheduler) -> None:
    """a, b, c with 7-token prompts in a 6-block cache: the step after next needs 3 more blocks."""
    step(s)  # prefill all three: 2 blocks each, all 6 used
    step(s)  # decode position 7: still inside block 2 of each


def test_preemption_picks_lowest_priority_and_victim_resumes_in_full() -> None:
    s = make_scheduler(num_blocks=6, max_model_len=24)
    s.add_request(request("a", 7, max_tokens=3))
    s.add_request(request("b", 7, priority=1, max_tokens=5))  # arrived second, lowest priority
    s.add_request(request("c", 7, max_tokens=3))
    fill_three(s)
    so, out = step(s)
    assert so.preempted_request_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1, "c": 1} and so.new_requests == []
    b = s.get_request("b")
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [TOKEN, TOKEN]
    assert out["a"].finish_reason is FinishReason.LENGTH and out["c"].finish_reason is FinishReason.LENGTH
    so, out = step(s)  # a and c finished: b comes back with its outputs
    (new_b,) = so.new_requests
    assert new_b.output_token_ids == [TOKEN, TOKEN] and new_b.prompt_token_ids == b.prompt_token_ids
    assert so.num_scheduled_tokens == {"b": 9 - new_b.num_computed_tokens}
    assert so.finished_request_ids == {"a", "c"}
    assert out["b"].new_token_ids == [TOKEN]
    types = event_types(out["b"])
    assert types[:3] == [EventType.PREEMPTED, EventType.QUEUED, EventType.SCHEDULED]
    assert EventType.FIRST_TOKEN not in types


def test_preemption_victim_is_latest_arrival_among_equals() -> None:
    s = make_scheduler(num_blocks=6, max_model_len=24)
    for rid in ("a", "b", "c"):
        s.add_request(request(rid, 7))
    fill_three(s)
    so, _ = step(s)
    assert so.preempted_request_ids == {"c"} and so.num_scheduled_tokens == {"a": 1, "b": 1}


def test_a_request_preempts_itself_when_it_is_the_lowest() -> None:
    s = make_scheduler(num_blocks=6, max_model_len=24)
    s.add_request(request("hi", 6))
    s.add_request(request("lo", 15, priority=9))
    step(s)  # hi 2 blocks, lo 4 blocks: all 6 used
    step(s)  # hi position 6, lo position 15: both inside their last block
    so, _ = step(s)  # lo needs a 5th block and is itself the lowest: it goes, hi stays
    assert so.preempted_request_ids == {"lo"} and so.num_scheduled_tokens == {"hi": 1}
    assert s.get_request("lo").status is RequestStatus.PREEMPTED
    assert s.get_request("hi").status is RequestStatus.RUNNING


# -- admission: no head-of-line blocking, priorities, aging ---------------------------------


def test_no_head_of_line_blocking() -> None:
    s = make_scheduler(num_blocks=8, max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=False)
    s.add_request(request("running", 16))  # 4 blocks
    step(s)
    s.add_request(request("huge", 20))  # needs 5 blocks, 4 free
    s.add_request(request("small", 4))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"running": 1, "small": 4}
    assert s.get_request("huge").status is RequestStatus.WAITING


def test_a_starving_request_never_blocks_admission_unchunked() -> None:
    # Formerly nothing could skip past a request that had waited aging_s (admission stopped
    # there until it fit): now smaller ones still run, and it goes first once it fits.
    clock = Clock(1000.0)
    s = make_scheduler(
        num_blocks=8, max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=False, aging_s=5.0,
        clock=clock,
    )
    s.add_request(request("running", 16, max_tokens=2))
    step(s)
    s.add_request(request("huge", 20))
    clock.now += 6.0  # huge has now waited past aging_s
    s.add_request(request("small", 4))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"running": 1, "small": 4}  # huge needs 5 blocks, 3 are free
    so, _ = step(s)  # running finished last step and freed its blocks: huge fits
    assert so.num_scheduled_tokens == {"small": 1, "huge": 20}


def test_a_starving_request_starts_in_the_blocks_that_are_free() -> None:
    clock = Clock(1000.0)
    s = make_scheduler(
        num_blocks=8, max_model_len=32, max_num_batched_tokens=32, max_long_partial_prefills=2, aging_s=5.0,
        clock=clock,
    )
    s.add_request(request("running", 26, max_tokens=2))  # 7 of 8 blocks
    step(s)
    s.add_request(request("huge", 20))
    s.add_request(request("fresh", 20))
    clock.now += 6.0  # both have waited past aging_s
    so, _ = step(s)
    # huge's chunk (8 tokens, 2 blocks) does not fit the one free block: as it is starving it
    # starts with the 4 tokens that do, rather than wait for 2 blocks to be free at once.
    assert so.num_scheduled_tokens == {"running": 1, "huge": 4}
    assert s.get_request("fresh").status is RequestStatus.WAITING  # no block left for it
    so, _ = step(s)  # running finished: huge goes on, fresh starts; the top-up stops at the blocks
    assert so.num_scheduled_tokens == {"huge": 16, "fresh": 12}
    assert s.kv_cache_usage == 1.0


def test_priority_orders_admission() -> None:
    clock = Clock(1000.0)
    s = make_scheduler(max_num_seqs=1, aging_s=10.0, clock=clock)
    s.add_request(request("batch", 3, priority=1, arrival_time=999.0, max_tokens=1))
    s.add_request(request("chat", 3, priority=0, arrival_time=1000.0, max_tokens=1))
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["chat"]


def test_aging_lifts_a_waiting_batch_request() -> None:
    clock = Clock(1015.0)
    s = make_scheduler(max_num_seqs=1, aging_s=10.0, clock=clock)
    # Waited 15 s: priority 1 → effective 0, and it arrived before the chat request.
    s.add_request(request("batch", 3, priority=1, arrival_time=1000.0, max_tokens=1))
    s.add_request(request("chat", 3, priority=0, arrival_time=1014.0, max_tokens=1))
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["batch"]


def test_a_class_that_does_not_age_stays_behind_interactive_requests() -> None:
    """The batch class (RequestSlo.ages False) fills idle capacity: however long a line waited,
    a request of a better priority goes first, admission and prefill alike."""
    clock = Clock(1100.0)
    s = make_scheduler(max_num_seqs=1, aging_s=10.0, clock=clock)
    line = request("line", 3, priority=1, arrival_time=1000.0, max_tokens=1)  # waited 10 aging periods
    line.slo = RequestSlo(slo_class="batch", ages=False)
    s.add_request(line)
    s.add_request(request("chat", 3, priority=0, arrival_time=1099.0, max_tokens=1))
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["chat"]
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["line"]


def test_unset_arrival_time_uses_the_core_clock() -> None:
    clock = Clock(1000.0)
    s = make_scheduler(clock=clock, aging_s=1.0)
    s.add_request(request("a", 3))  # arrival_time 0.0 would otherwise look ancient
    assert s.get_request("a").arrival_time == 1000.0


# -- defaults that one request cannot stall ------------------------------------------------


def default_scheduler(clock: Clock | None = None) -> Scheduler:
    """SchedulerConfig's defaults (budget 2048) with an 8k window and the KV pool to hold it."""
    kv = KVCacheManager(num_blocks=1024, block_size=16)
    return Scheduler(SchedulerConfig(max_model_len=8192), kv, eos_token_ids=[EOS], clock=clock or Clock())


def test_default_chunk_cap_leaves_room_next_to_a_long_prompt() -> None:
    config = SchedulerConfig()
    assert config.max_num_partial_prefills == 4 and config.max_long_partial_prefills == 1
    assert config.prefill_chunk_cap == config.max_num_batched_tokens // 4 == 512
    assert SchedulerConfig(long_prefill_token_threshold=0).prefill_chunk_cap == 0  # 0: no cap
    assert SchedulerConfig(enable_chunked_prefill=False).prefill_chunk_cap == 0


def test_a_short_request_arriving_mid_prefill_runs_within_two_steps_at_defaults() -> None:
    s = default_scheduler()
    s.add_request(request("long", 4096))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"long": 2048}  # alone, it still gets the whole budget
    s.add_request(request("short", 100))
    so, out = step(s)
    # The long chunk is capped at 512 while short wants budget; what is left returns to it.
    assert so.num_scheduled_tokens == {"long": 1948, "short": 100}
    assert out["short"].new_token_ids == [TOKEN]
    s.add_request(request("short2", 300))
    so, out = step(s)
    assert so.num_scheduled_tokens == {"short": 1, "long": 100, "short2": 300}
    assert out["long"].new_token_ids == [TOKEN]


def test_short_prompts_run_next_to_several_long_ones_at_defaults() -> None:
    s = default_scheduler()
    for rid in ("long1", "long2", "long3"):
        s.add_request(request(rid, 4000))
    step(s)
    for rid in ("s1", "s2", "s3"):
        s.add_request(request(rid, 200))
    so, out = step(s)
    # One long prompt at a time (max_long_partial_prefills 1): the short ones all fit next to it.
    assert so.num_scheduled_tokens == {"long1": 1448, "s1": 200, "s2": 200, "s3": 200}
    assert sorted(out) == ["s1", "s2", "s3"]


def test_a_realtime_request_never_waits_for_a_batch_prefill() -> None:
    s = default_scheduler()
    s.add_request(request("batch", 8000, priority=1))
    step(s)
    s.add_request(request("realtime", 3000, priority=0))
    so, _ = step(s)
    # The better class takes the one long slot: the batch prompt sits this step out, KV kept.
    assert so.num_scheduled_tokens == {"realtime": 2048} and so.preempted_request_ids == set()
    so, out = step(s)
    assert so.num_scheduled_tokens == {"realtime": 952, "batch": 1096}
    assert out["realtime"].new_token_ids == [TOKEN] and s.get_request("batch").num_computed_tokens == 3144


def test_a_better_class_takes_budget_from_a_running_worse_class_chunk() -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=256, num_blocks=128)
    s.add_request(request("batch", 200, priority=2))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"batch": 64}
    chats = ["chat1", "chat2", "chat3", "chat4"]
    for rid in chats:
        s.add_request(request(rid, 15, priority=0))
    so, out = step(s)
    # The running batch prompt's chunk shrinks to what the chat prompts leave: 64 → 4.
    assert so.num_scheduled_tokens == {**dict.fromkeys(chats, 15), "batch": 4} and so.preempted_request_ids == set()
    assert sorted(out) == chats
    so, _ = step(s)  # the decodes first, then the running prompt takes the rest
    assert so.num_scheduled_tokens == {**dict.fromkeys(chats, 1), "batch": 60}


def test_prompts_beyond_the_partial_slots_sit_the_step_out() -> None:
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=64, max_num_partial_prefills=2,
                       max_long_partial_prefills=2, long_prefill_token_threshold=4)  # fmt: skip
    for rid in ("a", "b", "c"):
        s.add_request(request(rid, 12))
    s.add_request(request("d", 3))
    so, _ = step(s)
    # a and b take both slots (4 each); c would be left unfinished too; d finishes: it runs;
    # the 5 tokens left go back to a.
    assert so.num_scheduled_tokens == {"a": 9, "b": 4, "d": 3}
    assert s.get_request("c").status is RequestStatus.WAITING


# -- abort ------------------------------------------------------------------------------


def test_abort_frees_blocks_and_reports_on_next_update() -> None:
    s = make_scheduler()
    s.add_request(request("run", 9))
    s.add_request(request("wait", 3))
    so = s.schedule()
    s.abort_requests(["run"])  # between schedule and update
    assert s.kv_cache_usage > 0  # "wait" still holds blocks
    outputs = s.update(so, sample_for_known(so))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["run"].finish_reason is FinishReason.ABORT and by_id["run"].new_token_ids == []
    assert event_types(by_id["run"])[-1] is EventType.FINISHED
    s.abort_requests(["wait", "wait", "unknown"])
    assert s.kv_cache_usage == 0.0 and s.num_running == 0
    assert s.has_unfinished_requests()  # the abort output is still owed
    so, out = step(s)
    assert so.is_empty and so.finished_request_ids == {"run", "wait"}
    assert out["wait"].finish_reason is FinishReason.ABORT
    assert not s.has_unfinished_requests()


def sample_for_known(so: SchedulerOutput) -> ModelOutput:
    return ModelOutput({rid: [TOKEN] for rid in so.num_scheduled_tokens})


def test_aborting_a_preempted_request_does_not_bother_the_runner() -> None:
    s = make_scheduler(num_blocks=6, max_model_len=24)
    for rid in ("a", "b", "c"):
        s.add_request(request(rid, 7))
    fill_three(s)
    so, _ = step(s)
    assert so.preempted_request_ids == {"c"}  # the runner dropped c here
    s.abort_requests(["c"])
    so, out = step(s)
    assert "c" not in so.finished_request_ids and out["c"].finish_reason is FinishReason.ABORT
    assert event_types(out["c"]) == [EventType.PREEMPTED, EventType.QUEUED, EventType.FINISHED]


def test_a_step_that_catches_up_without_a_token_is_refused() -> None:
    s = make_scheduler()
    s.add_request(request("a", 3))
    so = s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        s.update(so, ModelOutput({"a": []}))


def test_aborting_a_never_scheduled_request_does_not_bother_the_runner() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(request("a", 3))
    s.add_request(request("b", 3))
    step(s)
    s.abort_requests(["b"])
    so, out = step(s)
    assert so.finished_request_ids == set() and out["b"].finish_reason is FinishReason.ABORT


# -- stop conditions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "stop_reason", "num_outputs"),
    [
        ({}, [5, EOS, 5], FinishReason.STOP, None, 2),
        ({"stop_token_ids": [9]}, [5, 9, 5], FinishReason.STOP, 9, 2),
        ({"max_tokens": 3}, [5, 5, 5, 5], FinishReason.LENGTH, None, 3),
        ({"min_tokens": 2}, [EOS, EOS, EOS, 5], FinishReason.STOP, None, 3),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9, 9], FinishReason.STOP, 9, 3),
        ({"ignore_eos": True, "max_tokens": 4}, [EOS, EOS, EOS, EOS], FinishReason.LENGTH, None, 4),
        ({"ignore_eos": True, "stop_token_ids": [9]}, [EOS, 9], FinishReason.STOP, 9, 2),
        ({"max_tokens": 2}, [5, EOS], FinishReason.STOP, None, 2),  # a stop on the limit is a stop
        ({"max_tokens": None}, [5] * 20, FinishReason.LENGTH, None, 6),  # max_model_len 16 - 10
    ],
)
def test_stop_conditions(
    params: dict, tokens: list[int], reason: FinishReason, stop_reason: int | None, num_outputs: int
) -> None:
    s = make_scheduler(max_model_len=16)
    s.add_request(request("r", 10, **params))
    seen: list[int] = []
    for token in tokens:
        _, out = step(s, {"r": token})
        seen += out["r"].new_token_ids
        if out["r"].finish_reason is not None:
            break
    assert out["r"].finish_reason is reason and out["r"].stop_reason == stop_reason
    assert len(seen) == num_outputs and seen == tokens[:num_outputs]
    assert event_types(out["r"])[-1] is EventType.FINISHED
    assert not s.has_unfinished_requests() and s.kv_cache_usage == 0.0


# -- validation -------------------------------------------------------------------------------


def test_bad_requests_and_configs_raise() -> None:
    s = make_scheduler(max_model_len=16)
    s.add_request(request("a", 3))
    with pytest.raises(ValueError, match="already"):
        s.add_request(request("a", 3))
    with pytest.raises(ValueError, match="prompt"):
        s.add_request(request("b", 16))
    with pytest.raises(ValueError, match="prompt"):
        s.add_request(request("c", []))
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=100), KVCacheManager(4, 16))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024)
    with pytest.raises(ValueError, match="long_prefill"):
        SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=8, max_model_len=2048)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=0)
    with pytest.raises(ValueError, match="long_prefill"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="at most one"):
        CacheConfig(num_blocks=10, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)


# The step-time target and layered prefill: test_step_time_bound.py.
