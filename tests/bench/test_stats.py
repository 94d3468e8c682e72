"""Statistics on synthetic request records with known answers: percentiles, SLO attainment,
goodput, throughput, the TTFT split; the sweep's verdict; compare's ratios; JSON round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.bench.client import RequestRecord
from servelm.bench.compare import compare_summaries, format_comparison
from servelm.bench.profiles import parse_weights
from servelm.bench.report import load_report, run_report, summary_rows, write_json
from servelm.bench.stats import distribution, meets_slo, percentile, summarize
from servelm.bench.sweep import best_load, passes, reanalyse_sweep
from servelm.bench.workload import SLO, parse_slo

SLOS = {"voice": SLO(ttft_s=0.5, tbt_s=0.1), "analytics": SLO(ttft_s=10.0, e2e_s=20.0)}


def record(index: int, cls: str, ttft: float, gaps: list[float], *, sent: float = 0.0, status: str = "ok",
           prompt: int = 100, split: dict[str, float] | None = None) -> RequestRecord:  # fmt: skip
    """A finished request: first chunk at sent + ttft, then one chunk after each gap."""
    times = [sent + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(
        index=index, traffic_class=cls, priority=0, session_id=None, max_tokens=len(times),
        expected_prompt_tokens=prompt, shared_prefix_tokens=0, scheduled_s=sent, sent_s=sent,
        first_token_s=times[0] if status == "ok" else None, end_s=times[-1], chunk_times_s=times if status == "ok" else [],
        num_prompt_tokens=prompt, num_output_tokens=len(times), status=status, ttft_breakdown_s=split,
    )  # fmt: skip


def known_records() -> list[RequestRecord]:
    fast = [0.05] * 10
    voice = [record(i, "voice", 0.2, fast, sent=i) for i in range(6)]
    voice += [
        record(6, "voice", 0.6, fast),  # TTFT over 0.5 s: miss
        record(7, "voice", 0.2, [0.05] * 9 + [0.5]),  # one slow gap of 10: its own p90 gap is 0.095 s: met
        record(8, "voice", 0.2, [0.05] * 8 + [0.5] * 2),  # two slow gaps: p90 0.5 s: miss
        record(9, "voice", 0.2, fast, status="error"),  # failed: miss
    ]
    analytics = [record(10 + i, "analytics", 1.0, [0.5] * 10, prompt=1000) for i in range(3)]
    analytics += [record(13, "analytics", 1.0, [2.4] * 10, prompt=1000),  # E2E 25 s > 20 s: miss
                  record(14, "analytics", 1.0, [0.1], status="cancelled", prompt=1000)]  # cut off: miss  # fmt: skip
    return voice + analytics


def test_percentiles_and_distribution_have_known_values():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert distribution(values) == pytest.approx(
        {"count": 100, "mean": 50.5, "p50": 50.5, "p90": 90.1, "p95": 95.05, "p99": 99.01}
    )
    assert distribution([]) == {"count": 0.0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    assert percentile([], 90) is None


def test_a_request_meets_its_slo_by_ttft_own_tbt_percentile_and_e2e():
    met = [meets_slo(r, SLOS[r.traffic_class]) for r in known_records()]
    assert met == [True] * 6 + [False, True, False, False] + [True] * 3 + [False, False]
    assert meets_slo(record(0, "x", 9.0, [9.0]), None), "no SLO: success is enough"


def test_attainment_goodput_and_throughput_per_class_and_overall():
    summary = summarize(known_records(), SLOS, duration_s=10.0)
    voice, analytics, overall = summary.classes["voice"], summary.classes["analytics"], summary.overall
    assert (voice.num_requests, voice.num_ok, voice.num_errors, voice.num_met_slo) == (10, 9, 1, 7)
    assert voice.attainment == pytest.approx(0.7) and voice.goodput == pytest.approx(0.7)
    assert voice.slo_met is False
    assert (analytics.num_ok, analytics.num_cancelled, analytics.num_met_slo) == (4, 1, 3)
    assert analytics.attainment == pytest.approx(3 / 5) and analytics.goodput == pytest.approx(0.3)
    assert (overall.num_requests, overall.num_met_slo) == (15, 10)
    assert overall.attainment == pytest.approx(10 / 15) and overall.goodput == pytest.approx(1.0)
    assert overall.slo_met is False and not summary.all_classes_meet_slo
    # 13 successful requests, each 11 chunks (tokens); prompts 9 x 100 + 4 x 1000.
    assert overall.request_throughput == pytest.approx(1.3)
    assert overall.output_token_throughput == pytest.approx(13 * 11 / 10)
    assert overall.prompt_token_throughput == pytest.approx((900 + 4000) / 10)
    assert voice.ttft_s["p50"] == pytest.approx(0.2) and voice.ttft_s["count"] == 9
    # TBT pools every gap: voice has 90 gaps, 3 of them 0.5 s.
    assert voice.tbt_s["count"] == 90 and voice.tbt_s["mean"] == pytest.approx((87 * 0.05 + 3 * 0.5) / 90)
    assert analytics.tpot_s["p50"] == pytest.approx(0.5)  # (E2E - TTFT) / (11 - 1)


def test_the_slo_is_met_when_attainment_reaches_its_percentile():
    records = [record(i, "voice", 0.1, [0.01] * 4) for i in range(9)] + [record(9, "voice", 0.9, [0.01] * 4)]
    assert summarize(records, SLOS, 5.0).classes["voice"].slo_met is True  # exactly 90%
    strict = {"voice": SLO(ttft_s=0.5, percentile=95)}
    assert summarize(records, strict, 5.0).classes["voice"].slo_met is False


def test_ttft_split_means_and_the_network_remainder():
    split = {"ingress": 0.01, "queue": 0.1, "prefill": 0.05, "preemption": 0.0, "output": 0.02, "ttft": 0.18}
    records = [record(0, "voice", 0.2, [0.01], split=split),
               record(1, "voice", 0.3, [0.01], split={**split, "queue": 0.2, "ttft": 0.28}),
               record(2, "voice", 0.3, [0.01])]  # fmt: skip
    voice = summarize(records, SLOS, 1.0).classes["voice"]
    assert voice.num_with_breakdown == 2
    assert voice.ttft_breakdown_s == pytest.approx(
        # kv_load, kv_transfer, grammar: the splits name none of them (a server without KV tiers or
        # structured outputs, or an older one): 0 s
        {"ingress": 0.01, "queue": 0.15, "grammar": 0.0, "kv_load": 0.0, "kv_transfer": 0.0, "prefill": 0.05, "preemption": 0.0, "output": 0.02,
         "network": 0.02}
    )


def test_records_survive_json_and_give_the_same_summary():
    records = known_records()
    again = [RequestRecord.from_dict(raw) for raw in json.loads(json.dumps([r.to_dict() for r in records]))]
    assert again == records
    assert summarize(again, SLOS, 10.0).to_dict() == summarize(records, SLOS, 10.0).to_dict()


def _summary_at(attainment_by_class: dict[str, float]) -> dict:
    records, index = [], 0
    for cls, share in attainment_by_class.items():
        for i in range(10):
            records.append(record(index, cls, 0.1 if i < share * 10 else 99.0, [0.01]))
            index += 1
    return summarize(records, SLOS, 10.0).to_dict()


def test_the_sweep_picks_the_highest_load_where_every_class_reaches_the_target():
    steps = [
        {"load": 0.5, "summary": _summary_at({"voice": 1.0, "analytics": 1.0})},
        {"load": 1.0, "summary": _summary_at({"voice": 0.9, "analytics": 1.0})},
        {"load": 2.0, "summary": _summary_at({"voice": 0.8, "analytics": 1.0})},
        {"load": 4.0, "summary": _summary_at({"voice": 0.3, "analytics": 0.5})},
    ]
    assert [passes(s["summary"], 0.9) for s in steps] == [True, True, False, False]
    assert best_load(steps, 0.9) == 1.0
    assert best_load(steps, 0.75) == 2.0
    assert best_load(steps[3:], 0.9) is None


def test_a_saved_sweep_can_be_judged_again_by_other_slos(tmp_path: Path):
    steps = []
    for load, ttft in ((1.0, 0.3), (2.0, 0.8)):  # voice TTFT 0.3 s at 1 req/s, 0.8 s at 2 req/s
        records = [record(i, "voice", ttft, [0.01] * 3) for i in range(10)]
        summary = summarize(records, SLOS, 10.0)
        write_json(run_report(config={}, server={}, slos=SLOS, result={"duration_s": 10.0}, summary=summary,
                              records=records), tmp_path / f"rate_{load:g}" / "run.json")  # fmt: skip
        steps.append({"load": load, "dir": f"rate_{load:g}", "summary": summary.to_dict()})
    sweep = {"mode": "rate", "target_attainment": 0.9, "best": best_load(steps, 0.9), "steps": steps,
             "interrupted": False, "config": {"profile": "voice", "slos": {}}}  # fmt: skip
    assert sweep["best"] == 1.0
    looser = {"voice": SLO(ttft_s=1.0)}
    again = reanalyse_sweep(sweep, tmp_path, looser, tmp_path / "looser")
    assert again["best"] == 2.0
    assert load_report(tmp_path / "looser" / "rate_2" / "run.json")["summary"]["classes"]["voice"]["attainment"] == 1.0
    assert (
        "Highest rate with every class at >= 90% SLO attainment: 2 req/s"
        in (tmp_path / "looser" / "sweep.md").read_text()
    )


def test_compare_gives_per_metric_ratios():
    a = _summary_at({"voice": 1.0})
    slower = [record(i, "voice", 0.2, [0.02] * 4) for i in range(10)]
    b = summarize(slower, SLOS, 10.0).to_dict()
    rows = {(r.group, r.metric): r for r in compare_summaries(a, b)}
    ttft = rows[("voice", "TTFT p50 (ms)")]
    assert (ttft.a, ttft.b) == pytest.approx((100.0, 200.0)) and ttft.ratio == pytest.approx(2.0)
    assert ttft.better == "A"
    assert rows[("overall", "TBT p90 (ms)")].ratio == pytest.approx(2.0)
    assert rows[("overall", "requests/s")].ratio == pytest.approx(1.0) and rows[("overall", "requests/s")].better == ""
    text = format_comparison(list(rows.values()), "a.json", "b.json")
    assert "| voice | TTFT p50 (ms) | 100 | 200 | 2.000 | A |" in text


def test_markdown_rows_show_each_class_and_the_verdict():
    rows = summary_rows(summarize(known_records(), SLOS, 10.0).to_dict())
    assert len(rows) == 3
    assert rows[0].startswith("| voice | TTFT p90 <= 0.5 s, TBT p90 <= 0.1 s | 10 | 9 | 1 | 200 / ")
    assert "| 70% | 0.700 | **no** |" in rows[0]
    assert rows[2].startswith("| **overall** | each its own | 15 |")


def test_slo_and_weight_specs_parse_and_reject_nonsense():
    slos = parse_slo("voice:ttft=0.3,p=95", SLOS)
    assert slos["voice"] == SLO(ttft_s=0.3, percentile=95) and slos["analytics"] == SLOS["analytics"]
    assert parse_weights("voice=1,chat=0.5") == {"voice": 1.0, "chat": 0.5}
    for bad in ("voice", "voice:ttfb=1", "voice:ttft=-1", "voice:p=0"):
        with pytest.raises(ValueError):
            parse_slo(bad, SLOS)
    for bad in ("opera=1", "voice=-1", "voice=0"):
        with pytest.raises(ValueError):
            parse_weights(bad)


_records = st.lists(
    st.tuples(st.sampled_from(["voice", "analytics", "chat"]), st.floats(0.001, 20.0),
              st.lists(st.floats(0.001, 1.0), max_size=6), st.sampled_from(["ok", "ok", "error", "cancelled"])),
    min_size=1, max_size=40,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(_records, st.floats(0.5, 100.0))
def test_summaries_are_consistent_for_any_records(raw: list, duration: float):
    records = [record(i, cls, ttft, gaps, status=status) for i, (cls, ttft, gaps, status) in enumerate(raw)]
    summary = summarize(records, SLOS, duration)
    total_met = sum(c.num_met_slo for c in summary.classes.values())
    assert summary.overall.num_met_slo == total_met <= summary.overall.num_ok
    assert summary.overall.goodput * duration == pytest.approx(total_met)
    for group in [*summary.classes.values(), summary.overall]:
        assert 0.0 <= group.attainment <= 1.0
        assert group.num_ok + group.num_errors + group.num_cancelled == group.num_requests
        ttft = group.ttft_s
        if ttft["count"]:
            assert ttft["p50"] <= ttft["p90"] <= ttft["p95"] <= ttft["p99"]


def test_a_stream_cut_at_the_runs_end_counts_the_gaps_its_client_saw():
    """Survivorship: the window's end cuts the streams read slowest; their gaps are the TBT that grew."""
    finished = record(0, "chat", 0.1, [0.02] * 10)
    cut = record(1, "chat", 0.1, [0.5] * 4)
    cut.status = "cancelled"  # it had its first token and 4 gaps when the run ended
    failed = record(2, "chat", 0.1, [0.9] * 4)
    failed.status = "error"  # an error's gaps are not a reading speed: left out
    summary = summarize([finished, cut, failed], {}, 10.0)
    assert summary.overall.tbt_s["count"] == 14
    assert summary.overall.tbt_s["mean"] == pytest.approx((10 * 0.02 + 4 * 0.5) / 14)
    assert summary.overall.num_ok == 1 and summary.overall.num_cancelled == 1
