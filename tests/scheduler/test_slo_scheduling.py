"""SLO classes in the scheduler: deadline order, fair share between tenants of a class, the
step-time target following the running classes' TBT targets (scheduler/ranking.py)."""

from __future__ import annotations

import msgspec
import pytest
from test_scheduler import Clock, default_scheduler, fill_three, make_scheduler, request, step
from test_step_time_bound import bounded, run_step

from servelm.datatypes import EngineRequest, RequestSlo
from servelm.scheduler.ranking import FairShare, Ranking
from servelm.scheduler.request import Request
from servelm.scheduler.scheduler import Scheduler
from servelm.scheduler.step_cost import TBT_STEP_SHARE, step_time_target_s

REALTIME = RequestSlo(tenant="voice", slo_class="realtime", ttft_target_s=0.3, tbt_target_s=0.025)
BATCH = RequestSlo(tenant="docs", slo_class="batch", ttft_target_s=30.0)


def slo_request(request_id: str, prompt: int, slo: RequestSlo, **kwargs: object) -> EngineRequest:
    engine_request = request(request_id, prompt, **kwargs)  # type: ignore[arg-type]
    engine_request.slo = slo
    return engine_request


def tenant(name: str, slo: RequestSlo = BATCH) -> RequestSlo:
    return msgspec.structs.replace(slo, tenant=name)


def admitted(s: Scheduler) -> list[str]:
    so, _ = step(s)
    return [new.request_id for new in so.new_requests]


def test_a_request_keeps_its_slo() -> None:
    r = Request.from_engine_request(slo_request("a", 3, REALTIME), arrival_seq=0, now=1000.0)
    assert r.slo == REALTIME


# -- deadline order -------------------------------------------------------------------------


def test_a_realtime_request_never_waits_for_a_batch_prefill_with_classes() -> None:
    """Same priority, classes only: the realtime prompt takes the long slot from the running
    batch prompt in the next step (before classes it waited for all 8000 tokens)."""
    for classes in (True, False):
        s = default_scheduler()
        s.add_request(slo_request("batch", 8000, BATCH if classes else tenant("docs", RequestSlo())))
        step(s)
        s.add_request(slo_request("realtime", 3000, REALTIME if classes else tenant("voice", RequestSlo())))
        assert s.num_prefilling == 1
        so, _ = step(s)
        if not classes:  # the contrast: by arrival the batch prompt keeps the long slot
            assert so.num_scheduled_tokens == {"batch": 2048}
            continue
        assert so.num_scheduled_tokens == {"realtime": 2048} and so.preempted_request_ids == set()
        assert s.num_prefilling == 2  # both mid-prefill, the batch one kept its KV
        so, out = step(s)
        assert so.num_scheduled_tokens == {"realtime": 952, "batch": 1096}
        assert out["realtime"].new_token_ids == [7]


def test_waiting_requests_go_by_deadline_and_a_missing_target_counts_as_aging_s() -> None:
    clock = Clock(1000.0)
    s = make_scheduler(max_num_seqs=1, aging_s=10.0, clock=clock)
    interactive = RequestSlo(slo_class="interactive", ttft_target_s=1.0)
    s.add_request(slo_request("batch", 3, BATCH, arrival_time=995.0, max_tokens=1))  # due 1025
    s.add_request(slo_request("plain1", 3, RequestSlo(), arrival_time=999.0, max_tokens=1))  # due 1009
    s.add_request(slo_request("plain2", 3, RequestSlo(), arrival_time=999.5, max_tokens=1))  # due 1009.5
    s.add_request(slo_request("interactive", 3, interactive, arrival_time=1000.0, max_tokens=1))  # due 1001
    s.add_request(slo_request("realtime", 3, REALTIME, arrival_time=1000.5, max_tokens=1))  # due 1000.8
    order = [admitted(s) for _ in range(5)]
    assert order == [["realtime"], ["interactive"], ["plain1"], ["plain2"], ["batch"]]


def test_priority_still_comes_before_the_deadline() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(slo_request("realtime", 3, REALTIME, priority=1, max_tokens=1))
    s.add_request(slo_request("batch", 3, BATCH, priority=0, max_tokens=1))
    assert admitted(s) == ["batch"]


def test_the_preemption_victim_is_the_request_with_the_most_slack() -> None:
    s = make_scheduler(num_blocks=6, max_model_len=24)
    s.add_request(slo_request("a", 7, BATCH))  # arrived first, but due in 30 s
    s.add_request(slo_request("b", 7, REALTIME))
    s.add_request(slo_request("c", 7, REALTIME))
    fill_three(s)
    so, _ = step(s)
    assert so.preempted_request_ids == {"a"} and so.num_scheduled_tokens == {"b": 1, "c": 1}


# -- fair share between tenants of one class -------------------------------------------------


def test_a_flooding_tenant_does_not_starve_another_of_its_class() -> None:
    clock = Clock(1000.0)
    s = make_scheduler(max_num_seqs=4, clock=clock)
    for i in range(20):
        s.add_request(slo_request(f"a{i}", 8, tenant("A"), max_tokens=3))
    assert admitted(s) == ["a0", "a1", "a2", "a3"]
    clock.now += 0.1
    s.add_request(slo_request("b0", 8, tenant("B"), max_tokens=3))
    s.add_request(slo_request("b1", 8, tenant("B"), max_tokens=3))
    assert admitted(s) == []  # every seat decodes
    assert admitted(s) == []  # a0..a3 finish in this step
    # The first step with room: B's two go before A's backlog, and A still gets the other seats.
    assert admitted(s) == ["b0", "b1", "a4", "a5"]
    finished: set[str] = set()
    while s.has_unfinished_requests():
        _, out = step(s)
        finished |= {rid for rid, o in out.items() if o.finish_reason is not None}
    assert finished >= {f"a{i}" for i in range(4, 20)} | {"b0", "b1"}


def test_two_flooding_tenants_take_turns_by_tokens_served() -> None:
    s = make_scheduler(max_num_seqs=4)
    for i in range(6):
        s.add_request(slo_request(f"a{i}", 8, tenant("A"), max_tokens=2))
    for i in range(6):
        s.add_request(slo_request(f"b{i}", 8, tenant("B"), max_tokens=2))
    # A's requests arrived first; from the second turn on they alternate by tokens.
    assert admitted(s) == ["a0", "b0", "a1", "b1"]


def test_a_heavier_tenant_gets_turns_in_proportion_to_its_weight() -> None:
    s = make_scheduler(max_num_seqs=6)
    heavy = msgspec.structs.replace(tenant("A"), weight=2.0)
    for i in range(6):
        s.add_request(slo_request(f"a{i}", 8, heavy, max_tokens=2))
    for i in range(6):
        s.add_request(slo_request(f"b{i}", 8, tenant("B"), max_tokens=2))
    # Each of A's requests counts half its tokens against A: two of A's per one of B's.
    assert admitted(s) == ["a0", "b0", "a1", "a2", "b1", "a3"]


def test_other_classes_keep_their_deadline_order_under_fair_share() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(slo_request(f"a{i}", 8, tenant("A"), max_tokens=1))
    s.add_request(slo_request("b0", 8, tenant("B"), max_tokens=1))
    s.add_request(slo_request("rt", 8, REALTIME, max_tokens=1))
    # realtime is due first; the batch class's turns go to A's oldest, then to B (unserved).
    assert admitted(s) == ["rt", "a0"]
    assert admitted(s) == ["b0", "a1"]


def test_fair_share_decays_and_forgets() -> None:
    fair = FairShare(half_life_s=10.0)
    fair.decay(100.0)
    fair.add(tenant("A"), 64)
    fair.decay(110.0)
    assert fair.served("batch", "A") == pytest.approx(32.0)
    assert fair.served("batch", "B") == 0.0 and fair.served("realtime", "A") == 0.0
    fair.decay(110.0 + 10.0 * 20)  # 2**-20 of 32 tokens: nothing left worth keeping
    assert fair.served("batch", "A") == 0.0 and not fair._served


def test_ranking_without_targets_is_arrival_order() -> None:
    ranking = Ranking(aging_s=10.0)
    early = Request.from_engine_request(request("x", 3, arrival_time=1000.0), 0, 1000.0)
    late = Request.from_engine_request(request("y", 3, arrival_time=1001.0), 1, 1001.0)
    assert ranking.rank(early, 1005.0) < ranking.rank(late, 1005.0)
    assert ranking.rank(early, 1010.0)[0] == -1 and ranking.rank(late, 1010.0)[0] == 0  # aging


# -- step-time target from TBT targets ------------------------------------------------------


def test_step_time_target_is_the_tightest_of_max_step_ms_and_the_tbt_targets() -> None:
    assert step_time_target_s(0.0, []) is None
    assert step_time_target_s(0.0, [None]) is None
    assert step_time_target_s(50.0, [None]) == pytest.approx(0.05)
    assert step_time_target_s(0.0, [0.1, None, 0.025]) == pytest.approx(TBT_STEP_SHARE * 0.025)
    assert step_time_target_s(10.0, [0.1]) == pytest.approx(0.01)


def test_the_step_that_gives_a_realtime_prompt_its_first_token_stays_within_its_target() -> None:
    """No step-time target of its own (max_step_ms 0): a batch document alone takes the whole budget;
    a realtime prompt arriving is scheduled whole, and its step ends within its class's TBT share
    (its first token is due at the step's end), the document's chunk cut to what keeps it so."""
    s = bounded(max_step_ms=0.0, max_num_batched_tokens=256)
    s.add_request(slo_request("doc", 2000, BATCH))
    so, _, _ = run_step(s)
    assert so.num_scheduled_tokens == {"doc": 256}  # alone: the whole budget
    s.add_request(slo_request("rt", 10, REALTIME))
    so, out, seconds = run_step(s)
    assert so.num_scheduled_tokens["rt"] == 10 and out["rt"].new_token_ids
    assert seconds <= TBT_STEP_SHARE * REALTIME.tbt_target_s + 1e-9
    so, _, seconds = run_step(s)  # a realtime decode bounds the step now (or its floor: a block)
    assert so.num_scheduled_tokens["rt"] == 1
    assert seconds <= TBT_STEP_SHARE * REALTIME.tbt_target_s + 1e-9 or so.num_scheduled_tokens.get("doc", 0) <= 4


def test_a_realtime_stream_shortens_steps_and_batch_alone_lets_them_grow() -> None:
    s = bounded(max_step_ms=0.0, max_num_batched_tokens=256)
    s.add_request(slo_request("rt", 6, REALTIME, max_tokens=3))
    so, _, _ = run_step(s)
    assert so.num_scheduled_tokens == {"rt": 6}
    s.add_request(slo_request("doc", 600, BATCH))
    while s.get_request("rt") is not None:
        so, _, seconds = run_step(s)
        assert so.num_scheduled_tokens["rt"] == 1 and "doc" in so.scheduled_request_ids  # tokens or layers
        assert seconds <= TBT_STEP_SHARE * REALTIME.tbt_target_s + 1e-9
    so, _, _ = run_step(s)  # nobody decodes: no target; a chunk in flight finishes its layers at once
    so, _, _ = run_step(s)
    assert so.num_scheduled_tokens["doc"] == 256 and not so.layer_slices  # the whole budget again

