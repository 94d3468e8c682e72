"""Prometheus metrics: vLLM-style names under `servelm:`, labels by model, tenant and SLO class,
core gauges and counters read from the latest CoreStats at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from servelm.datatypes import EventType as E
from servelm.datatypes import RequestEvent, RequestSlo
from servelm.obs.attribution import TTFTBreakdown
from servelm.obs.metrics import FinishedRequest, ServerMetrics, length_buckets
from servelm.schemas.core_stats import CoreStats
from servelm.schemas.slo_class import priority_class

BATCH = RequestSlo(slo_class="batch")
INTERACTIVE = RequestSlo(slo_class="interactive")


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_buckets_and_priority_classes():
    assert length_buckets(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert [priority_class(p) for p in (-3, 0, 1, 10)] == ["interactive", "interactive", "batch", "batch"]


def test_request_and_core_metrics():
    stats = CoreStats(num_running=3, num_waiting=2, kv_usage=0.25, num_used_blocks=16, prefix_queries=100,
                      prefix_hits=40, prefix_evicted_misses=12, num_preemptions=1)  # fmt: skip
    metrics = ServerMetrics("tiny", 1024, lambda: stats, num_blocks=64, num_in_api=lambda: 5, num_outputs_queued=lambda: 7)
    events = [RequestEvent(E.ARRIVED, 10.0), RequestEvent(E.SCHEDULED, 10.5), RequestEvent(E.FIRST_TOKEN, 11.0),
              RequestEvent(E.FINISHED, 13.0)]  # fmt: skip
    metrics.observe_finished(FinishedRequest(slo=BATCH, finish_reason="length", num_prompt_tokens=7,
                                             num_generation_tokens=5, events=events, e2e_s=3.2))  # fmt: skip
    metrics.observe_token_gap(BATCH, 0.02)
    metrics.observe_ttft(INTERACTIVE, TTFTBreakdown(0.001, 0.0, 0.002, 0.0, 0.0, 0.003, 0.0, 0.001, 0.007, 0.007, 0.0005, 0.0001))
    s = _samples(metrics)
    batch = (("model_name", "tiny"), ("slo_class", "batch"), ("tenant", "default"))
    assert s[("servelm:request_queue_time_seconds_sum", batch)] == 0.5
    assert s[("servelm:request_prefill_time_seconds_sum", batch)] == 0.5
    assert s[("servelm:request_decode_time_seconds_sum", batch)] == 2.0
    assert s[("servelm:time_per_output_token_seconds_sum", batch)] == 0.5  # 2 s over 4 gaps
    assert s[("servelm:e2e_request_latency_seconds_sum", batch)] == 3.2
    assert s[("servelm:prompt_tokens_total", batch)] == 7 and s[("servelm:generation_tokens_total", batch)] == 5
    assert s[("servelm:request_success_total", (("finished_reason", "length"), *batch))] == 1
    assert s[("servelm:inter_token_latency_seconds_count", batch)] == 1
    interactive = (("model_name", "tiny"), ("slo_class", "interactive"), ("tenant", "default"))
    assert s[("servelm:time_to_first_token_seconds_count", interactive)] == 1
    assert s[("servelm:ttft_component_seconds_sum", (("component", "prefill"), *interactive))] == 0.003
    model = (("model_name", "tiny"),)
    assert s[("servelm:num_requests_running", model)] == 3 and s[("servelm:num_requests_waiting", model)] == 2
    assert s[("servelm:kv_cache_usage_perc", model)] == 0.25 and s[("servelm:kv_cache_used_blocks", model)] == 16
    assert s[("servelm:prefix_cache_queries_total", model)] == 100 and s[("servelm:prefix_cache_hits_total", model)] == 40
    assert s[("servelm:prefix_cache_evicted_misses_total", model)] == 12
    assert s[("servelm:num_preemptions_total", model)] == 1 and s[("servelm:num_requests_in_api", model)] == 5


def test_api_process_metrics():
    """Event-loop lag, and the output backlog both as a histogram per stream batch and as a gauge now."""
    metrics = ServerMetrics("tiny", 1024, CoreStats, num_blocks=8, num_in_api=lambda: 0, num_outputs_queued=lambda: 42)
    metrics.observe_loop_lag(0.3)
    for num_outputs in (0, 0, 3, 120):
        metrics.observe_output_backlog(INTERACTIVE, num_outputs)
    s = _samples(metrics)
    model = (("model_name", "tiny"),)
    assert s[("servelm:num_outputs_queued_in_api", model)] == 42
    assert s[("servelm:api_event_loop_lag_seconds_count", model)] == 1
    assert s[("servelm:api_event_loop_lag_seconds_bucket", (("le", "0.25"), *model))] == 0
    assert s[("servelm:api_event_loop_lag_seconds_bucket", (("le", "0.5"), *model))] == 1
    interactive = (*model, ("slo_class", "interactive"), ("tenant", "default"))
    bucket = "servelm:stream_output_backlog_bucket"
    assert s[(bucket, (("le", "0.0"), *interactive))] == 2  # a stream that keeps up: its own bucket
    assert s[(bucket, (("le", "5.0"), *interactive))] == 3
    assert s[(bucket, (("le", "100.0"), *interactive))] == 3 and s[(bucket, (("le", "200.0"), *interactive))] == 4
    assert s[("servelm:stream_output_backlog_sum", interactive)] == 123


def test_slo_met_counts_requests_within_their_class_targets():
    """Goodput per class: TTFT within target and the longest token gap within the TBT target;
    an abort never meets it; a class without targets is not counted at all."""
    metrics = ServerMetrics("tiny", 1024, CoreStats, num_blocks=8, num_in_api=lambda: 0, num_outputs_queued=lambda: 0)
    voice = RequestSlo(tenant="voice", slo_class="realtime", ttft_target_s=0.3, tbt_target_s=0.1)

    def finish(slo: RequestSlo, reason: str, ttft_s: float | None, gap_s: float | None) -> None:
        metrics.observe_finished(FinishedRequest(slo=slo, finish_reason=reason, num_prompt_tokens=3,
                                                 num_generation_tokens=4, events=[], e2e_s=1.0, ttft_s=ttft_s,
                                                 max_token_gap_s=gap_s))  # fmt: skip

    finish(voice, "stop", 0.2, 0.1)  # met (targets are inclusive)
    finish(voice, "length", 0.2, None)  # met: one token, no gap to judge
    finish(voice, "stop", 0.4, 0.05)  # TTFT missed
    finish(voice, "stop", 0.1, 0.11)  # one gap too long
    finish(voice, "abort", 0.1, 0.01)  # the client left: not goodput
    finish(BATCH, "stop", 0.1, 0.01)  # no targets: never counted
    s = _samples(metrics)
    labels = (("model_name", "tiny"), ("slo_class", "realtime"), ("tenant", "voice"))
    assert s[("servelm:request_slo_met_total", labels)] == 2
    assert sum(v for (name, lbl), v in s.items() if name == "servelm:request_success_total" and ("tenant", "voice") in lbl) == 5
    assert not any(name == "servelm:request_slo_met_total" and ("slo_class", "batch") in lbl for name, lbl in s)


def test_step_time_buckets_read_a_p99_against_a_step_target_to_within_15_percent():
    """Step-time targets are tens to hundreds of ms, and "step p99 <= 1.5x the target" is read from
    this histogram: from 10 to 200 ms its bounds are at most 15% apart (the token-gap buckets it
    used had 100 -> 150 ms), and 25/50/75/100 ms stay bounds (benchmarks/batch.py reads them)."""
    metrics = ServerMetrics("tiny", 1024, CoreStats, num_blocks=64, num_in_api=lambda: 0, num_outputs_queued=lambda: 0)
    bounds = sorted(float(dict(labels)["le"]) for name, labels in _samples(metrics)
                    if name == "servelm:engine_step_seconds_bucket")  # fmt: skip
    window = [b for b in bounds if 0.01 <= b <= 0.2]
    assert {0.025, 0.05, 0.075, 0.1} <= set(bounds)
    assert window[0] == 0.01 and window[-1] == 0.2
    assert all(high / low <= 1.15 for low, high in zip(window, window[1:]))
