"""TTFT attribution from hand-built event sequences: the split telescopes to the TTFT, and
preemption (waiting again + recomputing lost progress) is charged to `preemption`, not `prefill`."""

from __future__ import annotations

import pytest

from servelm.datatypes import EventType as E
from servelm.datatypes import RequestEvent
from servelm.obs.attribution import TTFTBreakdown, attribute_ttft, preemption_before
from servelm.obs.timeline import ApiStamp, RequestTimeline

T0 = 1_700_000_000.0  # a wall-clock origin; everything below is T0 + seconds


def approx(value: float):
    # Stamps near 1.7e9 s carry ~0.2 µs of float resolution.
    return pytest.approx(value, abs=1e-6)


def ev(kind: E, at: float, detail: int = 0) -> RequestEvent:
    return RequestEvent(kind, T0 + at, detail)


def _attribute(events: list[RequestEvent]) -> TTFTBreakdown:
    result = attribute_ttft(
        received=T0, sent_to_core=T0 + 0.002, first_output_received=T0 + 0.105, first_token_detokenized=T0 + 0.106,
        end=T0 + 0.107, ttft_mono=0.107, events=events,
    )  # fmt: skip
    assert result is not None
    return result


def test_plain_request_splits_at_each_hand_off():
    events = [ev(E.ARRIVED, 0.003), ev(E.QUEUED, 0.003), ev(E.SCHEDULED, 0.010),
              ev(E.PREFILL_CHUNK, 0.050, 64), ev(E.PREFILL_CHUNK, 0.100, 36), ev(E.FIRST_TOKEN, 0.100)]  # fmt: skip
    b = _attribute(events)
    assert b.ingress == approx(0.002)
    assert b.queue == approx(0.008)
    assert b.prefill == approx(0.090) and b.preemption == 0.0
    assert b.output == approx(0.007)
    assert b.core_to_api == approx(0.005) and b.detokenize == approx(0.001)
    assert sum(getattr(b, c) for c in TTFTBreakdown.COMPONENTS) == approx(b.ttft) == approx(0.107)


def test_a_kv_load_before_the_first_schedule_is_split_from_the_queue():
    # Queued 3 ms, its prefix loaded from a tier for 4 ms, queued again 1 ms, then scheduled.
    events = [ev(E.ARRIVED, 0.003), ev(E.QUEUED, 0.003), ev(E.KV_LOAD_STARTED, 0.005, 128),
              ev(E.KV_LOADED, 0.009, 128), ev(E.QUEUED, 0.009), ev(E.SCHEDULED, 0.010),
              ev(E.PREFILL_CHUNK, 0.100, 22), ev(E.FIRST_TOKEN, 0.100)]  # fmt: skip
    b = _attribute(events)
    assert b.kv_load == approx(0.004)
    assert b.queue == approx(0.008 - 0.004)
    assert b.prefill == approx(0.090) and b.preemption == 0.0
    assert sum(getattr(b, c) for c in TTFTBreakdown.COMPONENTS) == approx(b.ttft) == approx(0.107)


def test_preemption_charges_the_wait_and_the_recompute():
    # 60 tokens computed in 20 ms, preempted, 30 ms waiting, then a 100-token chunk of which 60
    # redo lost work: 60% of its 40 ms is recompute.
    events = [ev(E.ARRIVED, 0.003), ev(E.SCHEDULED, 0.005), ev(E.PREFILL_CHUNK, 0.025, 60),
              ev(E.PREEMPTED, 0.025), ev(E.QUEUED, 0.025), ev(E.SCHEDULED, 0.055),
              ev(E.PREFILL_CHUNK, 0.095, 100), ev(E.FIRST_TOKEN, 0.095)]  # fmt: skip
    assert preemption_before(events, T0 + 1.0) == approx(0.030 + 0.6 * 0.040)
    b = _attribute(events)
    assert b.preemption == approx(0.054)
    assert b.prefill == approx(0.090 - 0.054)
    assert sum(getattr(b, c) for c in TTFTBreakdown.COMPONENTS) == approx(b.ttft)


def test_repeated_preemption_redoes_up_to_the_high_water_mark():
    events = [ev(E.SCHEDULED, 0.0), ev(E.PREFILL_CHUNK, 0.010, 100), ev(E.PREEMPTED, 0.010),
              ev(E.SCHEDULED, 0.020), ev(E.PREFILL_CHUNK, 0.025, 50), ev(E.PREEMPTED, 0.025),
              ev(E.SCHEDULED, 0.035), ev(E.PREFILL_CHUNK, 0.055, 200), ev(E.FIRST_TOKEN, 0.055)]  # fmt: skip
    # waits: 10 + 10 ms; the 50-token chunk is all redo (5 ms); of the last 200, 100 are redo (10 ms).
    assert preemption_before(events, T0 + 1.0) == approx(0.020 + 0.005 + 0.010)


def test_preemption_after_the_first_token_does_not_count():
    events = [ev(E.SCHEDULED, 0.0), ev(E.PREFILL_CHUNK, 0.010, 10), ev(E.FIRST_TOKEN, 0.010),
              ev(E.PREEMPTED, 0.020), ev(E.SCHEDULED, 0.050)]  # fmt: skip
    assert preemption_before(events, T0 + 0.010) == 0.0


def test_no_breakdown_without_core_events():
    assert attribute_ttft(received=T0, sent_to_core=T0, first_output_received=T0, first_token_detokenized=T0,
                          end=T0, ttft_mono=0.0, events=[ev(E.ARRIVED, 0.0)]) is None  # fmt: skip


def test_timeline_picks_the_choice_that_produced_the_first_token():
    timeline = RequestTimeline("cmpl-1", streaming=True)
    for stamp, at in ((ApiStamp.RECEIVED, 0.0), (ApiStamp.SENT_TO_CORE, 0.001), (ApiStamp.FIRST_OUTPUT_RECEIVED, 0.031),
                      (ApiStamp.FIRST_TOKEN_DETOKENIZED, 0.032), (ApiStamp.FIRST_BYTE_WRITTEN, 0.033)):  # fmt: skip
        timeline.stamp(stamp, T0 + at, at)
    timeline.stamp(ApiStamp.RECEIVED, T0 + 5.0, 5.0)  # first write wins
    timeline.choice_events[0] = [ev(E.SCHEDULED, 0.002), ev(E.FIRST_TOKEN, 0.040)]
    timeline.choice_events[1] = [ev(E.SCHEDULED, 0.002), ev(E.FIRST_TOKEN, 0.030)]
    assert timeline.first_token_choice() == 1
    b = timeline.breakdown()
    assert b is not None and b.prefill == approx(0.028) and b.ttft == approx(0.033)
    record = timeline.to_dict()
    assert record["api_ms"]["received"] == 0.0 and record["api_ms"]["first_byte_written"] == 33.0
    assert record["choices"][1]["events"][1] == {"type": "first_token", "t_ms": 30.0, "detail": 0}
    assert record["ttft_breakdown_ms"]["ttft"] == 33.0


def test_header_value_lists_milliseconds():
    b = TTFTBreakdown(0.001, 0.0, 0.002, 0.0, 0.0, 0.003, 0.0, 0.0005, 0.0065, 0.0065, 0.0002, 0.0001)
    parts = dict(p.split("=") for p in b.header_value().split(";"))
    assert parts["ingress"] == "1.000" and parts["output"] == "0.500" and parts["ttft"] == "6.500"
