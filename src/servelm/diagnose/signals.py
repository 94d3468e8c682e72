"""From a window (metrics, or a request log) to the named signals diagnose compares.

ttft_mean_s       what the causes must explain: the server's mean TTFT per request, plus the
                  network component when the client side (bench.json) is known
components        mean seconds per request: ingress, queue, prefill, preemption, output
                  (servelm:ttft_component_seconds), and network (client TTFT − server TTFT)
values            every other signal by name (SIGNAL_DOCS); None when the source lacks it
classes           TTFT and its components per SLO class (label `slo_class`, or older
                  servers' `priority`), where the source has classes
evictions_by_tenant   prefix-cache blocks evicted per second, by the tenant that cached them
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from servelm.diagnose.request_log import LoggedRequest, RequestLog
from servelm.diagnose.window import Histogram, Window
from servelm.schemas.ttft import NETWORK, TTFT_COMPONENTS, percentile

COMPONENTS = (*TTFT_COMPONENTS, NETWORK)
P = "servelm:"
CLASS_LABELS = ("slo_class", "priority")  # today's label, then the one it replaced

SIGNAL_DOCS = {
    "request_rate": "requests finished per second",
    "prompt_tokens_per_request": "mean prompt tokens per request",
    "prompt_tokens_p50": "median prompt tokens per request (the typical request, not the tail)",
    "uncached_prompt_tokens_per_request": "mean prompt tokens per request not found in the prefix cache (computed)",
    "generation_tokens_per_request": "mean generated tokens per request",
    "prompt_tokens_per_s": "prompt tokens per second (rate x length: the offered prefill work)",
    "ttft_p50_s": "server TTFT p50",
    "ttft_p90_s": "server TTFT p90",
    "ttft_p99_s": "server TTFT p99",
    "client_ttft_mean_s": "client-measured TTFT mean (bench.json)",
    "client_ttft_p90_s": "client-measured TTFT p90 (bench.json)",
    "itl_mean_s": "server time between a stream's tokens (taken by the stream in the API), mean",
    "itl_p90_s": "server time between a stream's tokens, p90",
    "client_tbt_mean_s": "client-measured time between tokens, mean (bench.json)",
    "client_tbt_p90_s": "client-measured time between tokens, p90 (bench.json)",
    "waiting_mean": "requests in the waiting queue, mean",
    "waiting_max": "requests in the waiting queue, max",
    "running_mean": "requests running, mean",
    "step_time_mean_s": "engine step time, mean",
    "step_time_p90_s": "engine step time, p90",
    "tokens_per_step_mean": "tokens scheduled per step, mean",
    "partial_prefills_mean": "prompts mid-prefill (partial prefills), mean",
    "preemptions_per_s": "preemptions per second",
    "prefix_hit_rate": "prefix-cache hits / queries (prompt tokens)",
    "prefix_evictions_per_s": "hashed blocks evicted from the prefix cache per second",
    "prefix_loss_rate": "prompt tokens missed because their cached blocks were evicted / (those + hits)",
    "kv_usage_mean": "KV cache usage (0-1), mean",
    "kv_usage_max": "KV cache usage (0-1), max",
    "output_backlog_mean": "outputs waiting in a stream's queue when it takes them, mean",
    "outputs_queued_mean": "engine outputs waiting in the API for their streams, mean",
    "outputs_queued_max": "engine outputs waiting in the API for their streams, max",
    "step_prediction_ratio_p10": "engine step time measured / predicted by the step-cost model, p10 (1: exact)",
    "step_prediction_ratio_p90": "engine step time measured / predicted by the step-cost model, p90 (1: exact)",
    "deep_step_prediction_ratio_p90": "... of steps with a chunk after 1,024+ prompt tokens, p90",
    "step_target_s": "the step-time target every step is sized to (0: none)",
    "loop_lag_mean_s": "API event-loop lag, mean",
    "loop_lag_p99_s": "API event-loop lag, p99",
}


@dataclass
class ClassSignals:
    num_requests: float
    ttft_mean_s: float | None
    ttft_p90_s: float | None
    components: dict[str, float | None]


@dataclass
class Signals:
    label: str
    source: str
    duration_s: float
    ttft_mean_s: float | None
    components: dict[str, float | None]
    values: dict[str, float | None]
    classes: dict[str, ClassSignals] = field(default_factory=dict)
    evictions_by_tenant: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)


def _mean(histogram: Histogram | None) -> float | None:
    return None if histogram is None else histogram.mean


def _quantile(histogram: Histogram | None, q: float) -> float | None:
    return None if histogram is None else histogram.quantile(q)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def window_signals(window: Window) -> Signals:
    ttft = window.histogram(P + "time_to_first_token_seconds")
    client = window.client
    components = _components(window, {})
    unseen_queue_s = _unfinished_queue_s(window, components)
    if unseen_queue_s:
        components["queue"] = (components["queue"] or 0.0) + unseen_queue_s
    network = components[NETWORK]
    server_ttft = _plus(_mean(ttft), network) if network is not None else _mean(ttft)
    requests = window.counter(P + "request_success")
    prompt_tokens = window.counter(P + "prompt_tokens")
    queries, hits = window.counter(P + "prefix_cache_queries"), window.counter(P + "prefix_cache_hits")
    evicted_misses = window.counter(P + "prefix_cache_evicted_misses")
    step, step_tokens = window.histogram(P + "engine_step_seconds"), window.histogram(P + "iteration_tokens")
    lag = window.histogram(P + "api_event_loop_lag_seconds")
    itl = window.histogram(P + "inter_token_latency_seconds")
    prediction = window.histogram(P + "step_time_prediction_ratio")
    values: dict[str, float | None] = {
        "request_rate": _ratio(requests, window.duration_s) if requests is not None else _client_rate(window),
        "prompt_tokens_per_request": _ratio(prompt_tokens, requests),
        "prompt_tokens_p50": _quantile(window.histogram(P + "request_prompt_tokens"), 0.5),
        "uncached_prompt_tokens_per_request": _ratio(_minus(prompt_tokens, hits), requests),
        "generation_tokens_per_request": _ratio(window.counter(P + "generation_tokens"), requests),
        "prompt_tokens_per_s": window.rate(P + "prompt_tokens"),
        "ttft_p50_s": _quantile(ttft, 0.5),
        "ttft_p90_s": _quantile(ttft, 0.9),
        "ttft_p99_s": _quantile(ttft, 0.99),
        "client_ttft_mean_s": client.ttft_s.get("mean") if client else None,
        "client_ttft_p90_s": client.ttft_s.get("p90") if client else None,
        "itl_mean_s": _mean(itl),
        "itl_p90_s": _quantile(itl, 0.9),
        "client_tbt_mean_s": client.tbt_s.get("mean") if client else None,
        "client_tbt_p90_s": client.tbt_s.get("p90") if client else None,
        "waiting_mean": _gauge(window, "num_requests_waiting", "mean"),
        "waiting_max": _gauge(window, "num_requests_waiting", "max"),
        "running_mean": _gauge(window, "num_requests_running", "mean"),
        "step_time_mean_s": _mean(step),
        "step_time_p90_s": _quantile(step, 0.9),
        "tokens_per_step_mean": _mean(step_tokens),
        "partial_prefills_mean": _gauge(window, "num_requests_prefilling", "mean"),
        "preemptions_per_s": window.rate(P + "num_preemptions"),
        "prefix_hit_rate": _ratio(hits, queries),
        "prefix_evictions_per_s": window.rate(P + "prefix_cache_evicted_blocks"),
        # Of the prompt tokens the cache held (or had held), the share lost to evictions: unlike
        # the hit rate, not lowered by new unique prompts (a long document hits nothing either way).
        "prefix_loss_rate": _ratio(evicted_misses, _plus(hits, evicted_misses)),
        "kv_usage_mean": _gauge(window, "kv_cache_usage_perc", "mean"),
        "kv_usage_max": _gauge(window, "kv_cache_usage_perc", "max"),
        "output_backlog_mean": _mean(window.histogram(P + "stream_output_backlog")),
        "outputs_queued_mean": _gauge(window, "num_outputs_queued_in_api", "mean"),
        "outputs_queued_max": _gauge(window, "num_outputs_queued_in_api", "max"),
        "step_prediction_ratio_p10": _quantile(prediction, 0.1),
        "step_prediction_ratio_p90": _quantile(prediction, 0.9),
        "deep_step_prediction_ratio_p90": _quantile(window.histogram(P + "step_time_prediction_ratio", kind="deep"), 0.9),
        "step_target_s": _gauge(window, "step_time_target_seconds", "max"),
        "loop_lag_mean_s": _mean(lag),
        "loop_lag_p99_s": _quantile(lag, 0.99),
    }
    evictions = window.counter_by(P + "prefix_cache_evicted_blocks", "tenant")
    notes = []
    if unseen_queue_s:
        notes.append(
            f"{window.label}: requests still waiting at the window's end have no TTFT yet; the queue time per request "
            f"is Little's law's (mean waiting / arrival rate), {unseen_queue_s * 1000:.0f} ms more than finished requests show"
        )
    drift = prediction_drift(values)
    if drift:
        notes.append(f"{window.label}: {drift}")
    if ttft is None and window.has(P + "router_requests"):
        notes.append(
            "this source is a servelm router: its /metrics carry router-level signals only (no TTFT split, queue "
            "or KV); capture a replica's /metrics for the engine-side signals"
        )
    elif ttft is None:
        notes.append("no servelm:time_to_first_token_seconds in this source: the server TTFT is unknown")
    return Signals(
        label=window.label,
        source=window.source,
        duration_s=window.duration_s,
        ttft_mean_s=_plus(server_ttft, unseen_queue_s) if unseen_queue_s else server_ttft,
        components=components,
        values=values,
        classes=_window_classes(window),
        evictions_by_tenant={t: n / window.duration_s for t, n in evictions.items()} if evictions is not None else None,
        notes=notes,
    )


# The step-cost model has drifted when a tenth of steps run this far from what it predicted: the
# step-time target (what arrivals wait at most) no longer holds as planned.
PREDICTION_DRIFT = 0.25


def prediction_drift(values: dict[str, float | None]) -> str | None:
    """A note when the step-cost model's predictions drift past PREDICTION_DRIFT (p10 or p90 of
    measured / predicted), else None."""
    low, high = values.get("step_prediction_ratio_p10"), values.get("step_prediction_ratio_p90")
    if low is None or high is None or (1 - PREDICTION_DRIFT <= low and high <= 1 + PREDICTION_DRIFT):
        return None
    target = values.get("step_target_s")
    bound = f" against a {target * 1000:.0f} ms step-time target" if target else ""
    return (
        f"the step-cost model is off: steps took {low:.2f}x-{high:.2f}x what it predicted (p10-p90){bound}; "
        "steps are sized by it, so they run longer (or shorter) than the target says. Something else on the machine, "
        "or a shape of step the start-up calibration did not see: it refits from the steps it runs"
    )


def _unfinished_queue_s(window: Window, components: dict[str, float | None]) -> float | None:
    """Queue time the finished requests do not show. The histograms only hold requests that got
    their first token, so an overloaded window looks fast (its slow requests never finish in it).
    Little's law counts every arrival: mean queue time = mean waiting / arrival rate. Known only
    with the client's arrival rate (bench.json); the excess over the histogram's mean, or None."""
    waiting = _gauge(window, "num_requests_waiting", "mean")
    arrivals = window.client.arrival_rate if window.client is not None else None
    if waiting is None or not arrivals:
        return None
    seen = components["queue"] or 0.0
    little = waiting / arrivals
    # Both estimate the same mean in a steady window: only a clear excess is requests left waiting.
    return little - seen if little > 1.5 * seen and little - seen > 0.05 else None


def _client_rate(window: Window) -> float | None:
    if window.client is not None:
        return window.client.request_rate
    return window.rate(P + "router_requests")


def _gauge(window: Window, name: str, stat: str) -> float | None:
    summary = window.gauge(P + name)
    return None if summary is None else getattr(summary, stat)


def _components(window: Window, where: dict[str, str]) -> dict[str, float | None]:
    """Mean seconds per request of each TTFT component; queue/prefill from the core's own histograms
    when the server has no TTFT split (vLLM's names, an older servelm)."""
    out: dict[str, float | None] = {}
    for name in TTFT_COMPONENTS:
        out[name] = _mean(window.histogram(P + "ttft_component_seconds", component=name, **where))
    if out["queue"] is None:
        out["queue"] = _mean(window.histogram(P + "request_queue_time_seconds", **where))
    if out["prefill"] is None:
        out["prefill"] = _mean(window.histogram(P + "request_prefill_time_seconds", **where))
    out[NETWORK] = _network(window) if not where else None
    return out


def _network(window: Window) -> float | None:
    """Client TTFT less the server's: the bench's own per-request figure, else the difference of the means."""
    client = window.client
    if client is None:
        return None
    if client.network_s is not None:
        return client.network_s
    return _plus(client.ttft_s.get("mean"), _neg(_mean(window.histogram(P + "time_to_first_token_seconds"))))


def _minus(value: float | None, less: float | None) -> float | None:
    return None if value is None or less is None else max(value - less, 0.0)


def _neg(value: float | None) -> float | None:
    return None if value is None else -value


def _window_classes(window: Window) -> dict[str, ClassSignals]:
    name = P + "time_to_first_token_seconds"
    label = next((lab for lab in CLASS_LABELS if window.label_values(name, lab)), None)
    if label is None:
        return {}
    out = {}
    for value in window.label_values(name, label):
        ttft = window.histogram(name, **{label: value})
        if ttft is not None and ttft.count > 0:
            components = _components(window, {label: value})
            out[value] = ClassSignals(ttft.count, ttft.mean, ttft.quantile(0.9), components)
    return out


def request_log_signals(log: RequestLog) -> Signals:
    """The signals a request log carries: TTFT and its split (exact, per request), load, preemptions."""
    timed = [r for r in log.requests if r.ttft_s is not None]
    prompts = [r.prompt_tokens for r in log.requests]
    values: dict[str, float | None] = dict.fromkeys(SIGNAL_DOCS)
    num = len(log.requests)
    values.update(
        request_rate=log.request_rate,
        prompt_tokens_per_request=sum(prompts) / num,
        prompt_tokens_p50=float(statistics.median(prompts)),
        generation_tokens_per_request=sum(r.completion_tokens for r in log.requests) / num,
        prompt_tokens_per_s=sum(prompts) / log.duration_s if num > 1 else None,
        ttft_p50_s=percentile((r.ttft_s for r in timed if r.ttft_s is not None), 50),
        ttft_p90_s=percentile((r.ttft_s for r in timed if r.ttft_s is not None), 90),
        ttft_p99_s=percentile((r.ttft_s for r in timed if r.ttft_s is not None), 99),
        preemptions_per_s=sum(r.num_preemptions for r in log.requests) / log.duration_s if num > 1 else None,
    )
    classes = {}
    for slo_class in sorted({r.slo_class for r in timed}):
        members = [r for r in timed if r.slo_class == slo_class]
        classes[slo_class] = ClassSignals(
            len(members),
            statistics.fmean(r.ttft_s for r in members if r.ttft_s is not None),
            percentile((r.ttft_s for r in members if r.ttft_s is not None), 90),
            _logged_components(members),
        )
    return Signals(
        label=log.label,
        source=log.source,
        duration_s=log.duration_s,
        ttft_mean_s=statistics.fmean(r.ttft_s for r in timed if r.ttft_s is not None) if timed else None,
        components=_logged_components(timed),
        values=values,
        classes=classes,
        notes=["source: a request log (TTFT split per request; no gauges, step or cache signals)"],
    )


def _logged_components(requests: list[LoggedRequest]) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        c: statistics.fmean(r.components_s[c] for r in requests) if requests else None for c in TTFT_COMPONENTS
    }
    out[NETWORK] = None
    return out
