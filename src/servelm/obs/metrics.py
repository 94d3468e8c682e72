"""Prometheus metrics, named after vLLM's (`vllm:` → `servelm:`) so existing dashboards map over.

Two sources:
- per request, observed in the API process when a request finishes (latency histograms,
  token counters, finish reasons), labelled by model, tenant and SLO class (the request's
  RequestSlo; without a tenants file tenant "default" and the class its priority names,
  `schemas.slo_class.priority_class`); and per-class goodput, `request_slo_met` (see `slo_met`);
- the engine core's own counters and gauges (running / waiting requests, KV usage,
  prefix-cache queries and hits, preemptions), which arrive with every output batch as
  `CoreStats` and are read at scrape time by a custom collector, so they are never stale
  by more than one engine step (or one abort, see core_process);
- the API process's own health: its event loop's lag (obs.loop_lag) and the output backlog,
  engine outputs that wait in the API for a client (or the API itself) to take them;
- how the start-up went: `startup_seconds` per phase (obs.startup), filled in once the engine is
  ready (`starting_metrics` is what /metrics answers before that); `engine_restarts_total`, dead
  engine cores replaced (engine.supervisor). A replacement core's own counters (prefix cache,
  preemptions) start again from 0: Prometheus reads that as a counter reset.

Each server owns its own CollectorRegistry: two servers in one process (tests) never collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servelm.datatypes import EventType, RequestEvent, RequestSlo
from servelm.kv.block_pool import MAX_GHOSTS
from servelm.obs.attribution import PULL_EVENTS, TTFTBreakdown, kv_load_spans
from servelm.obs.startup import PHASES
from servelm.schemas.core_stats import CoreStats, TierStats

PREFIX = "servelm:"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# Engine steps: the step-time target is tens to hundreds of milliseconds (a GPU, a CPU), and "p99
# within 1.5x the target" is read from these, so from 10 to 200 ms they are at most ~14% apart (with
# the token-gap buckets a p99 between 100 and 150 ms was the interpolation's guess); 25/50/75/100 ms
# stay bounds (benchmarks/batch.py reads them).
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.011, 0.012, 0.0135, 0.015, 0.0165, 0.018, 0.02, 0.022, 0.025,
                 0.0275, 0.03, 0.033, 0.036, 0.04, 0.044, 0.048, 0.05, 0.055, 0.06, 0.065, 0.07, 0.075, 0.08, 0.088,
                 0.096, 0.1, 0.11, 0.12, 0.135, 0.15, 0.165, 0.18, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# measured / predicted of a step's time: 1 is a perfect prediction, 1.25 a step 25% longer than planned
_PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.65, 0.75, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.25, 1.35, 1.5, 1.75, 2.0,
                             3.0, 5.0)
_LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)  # a step's masks: ~50 µs per row
# 0 is its own bucket: a stream that keeps up never has an output waiting.
_BACKLOG_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 50000.0)


def length_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


@dataclass
class FinishedRequest:
    """What the API knows about one engine request (one choice) when it finishes."""

    slo: RequestSlo
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    events: list[RequestEvent]
    e2e_s: float  # HTTP received → finished in the API
    ttft_s: float | None = None  # HTTP received → its first token detokenized in the API; None: no token
    max_token_gap_s: float | None = None  # its longest gap between two tokens in the API; None: under two tokens


def slo_met(request: FinishedRequest) -> bool | None:
    """Did the request keep its class's promise? None: the class promises nothing (no targets).

    Met: it finished normally (stop or length; an abort or error never meets it), its TTFT is
    within the TTFT target, and its longest gap between tokens (the max, not a percentile: one
    stall is what a listener hears) is within the TBT target. A target of None is not judged.
    """
    slo = request.slo
    if slo.ttft_target_s is None and slo.tbt_target_s is None:
        return None
    if request.finish_reason not in ("stop", "length"):
        return False
    ttft_ok = slo.ttft_target_s is None or (request.ttft_s is not None and request.ttft_s <= slo.ttft_target_s)
    gap = request.max_token_gap_s
    tbt_ok = slo.tbt_target_s is None or gap is None or gap <= slo.tbt_target_s
    return ttft_ok and tbt_ok


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        core_stats: Callable[[], CoreStats],
        num_blocks: int,
        num_in_api: Callable[[], int],
        num_outputs_queued: Callable[[], int],
        startup_seconds: Mapping[str, float] | None = None,
    ) -> None:
        """`core_stats`, `num_in_api` and `num_outputs_queued` are read at every scrape (on the event loop);
        `startup_seconds`: seconds per start-up phase (StartupTimeline.seconds_by_phase)."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(StartupCollector(model_name, startup_seconds or {}))
        labels = ["model_name", "tenant", "slo_class"]

        def histogram(name: str, doc: str, buckets: Iterable[float], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, labels + list(extra), buckets=tuple(buckets), registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        lengths = length_buckets(max_model_len)
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token (HTTP received → first token out).", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive outputs of a request.", _TOKEN_GAP_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds", "Decode time / (generated tokens - 1).", _TOKEN_GAP_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "HTTP received → finished.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Core: arrived → first scheduled.", _REQUEST_BUCKETS)
        self.prefill = histogram(
            "request_prefill_time_seconds", "Core: first scheduled → first token.", _REQUEST_BUCKETS
        )
        self.decode = histogram("request_decode_time_seconds", "Core: first token → finished.", _REQUEST_BUCKETS)
        self.kv_load = histogram(
            "kv_load_seconds", "Core: one load of a prompt prefix's KV from a tier into the pool.", _LATENCY_BUCKETS
        )
        self.kv_pull = histogram(
            "kv_pull_seconds",
            "Core (decode worker): one pull of a prompt's KV from a prefill worker, its prefill included "
            "(blocks stream as they are computed).",
            _LATENCY_BUCKETS,
        )
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.generation_len = histogram("request_generation_tokens", "Generated tokens per request.", lengths)
        self.ttft_component = histogram(
            "ttft_component_seconds",
            "TTFT split by cause (see servelm.obs.attribution).",
            _LATENCY_BUCKETS,
            ("component",),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.request_slo_met = counter(
            "request_slo_met",
            "Finished requests that met their SLO class's TTFT and TBT targets (classes with targets only; "
            "TBT: the request's longest gap between tokens). Goodput per class: this over request_success.",
        )
        self.output_backlog = histogram(
            "stream_output_backlog",
            "Engine outputs waiting in a stream's queue each time the stream takes them, beyond the newest one per "
            "choice; and, when a stream ends before its choices did (the client left), the outputs it never took. "
            "0 while the client and the API keep up with the engine; grows by one per choice per engine step "
            "while a client does not read (its SSE writes block, the engine keeps generating).",
            _BACKLOG_BUCKETS,
        )
        self.streams_cut = Counter(PREFIX + "streams_cut", "Responses cut because their client took no data for "
                                   "--stream-stall-timeout-s, or fell --max-stream-backlog outputs behind "
                                   "(openai_api/stall_guard.py).", ["model_name"], registry=self.registry).labels(model_name)  # fmt: skip
        self.engine_restarts = Counter(PREFIX + "engine_restarts", "Engine cores launched to replace a dead one "
                                       "(engine.supervisor), whether or not they came up.", ["model_name"],
                                       registry=self.registry).labels(model_name)  # fmt: skip
        self.registry.register(_CoreCollector(model_name, core_stats, num_blocks, num_in_api, num_outputs_queued))
        # Observed per output batch of every stream: their labelled children are cached.
        self._itl_by_class = _ByClass(self.itl, model_name)
        self._backlog_by_class = _ByClass(self.output_backlog, model_name)
        # Per engine step (no priority: a step serves every class at once). A long TBT is a long
        # step; these say how long steps run and how many tokens they carry (vLLM: iteration_tokens).
        self.step_seconds = Histogram(PREFIX + "engine_step_seconds", "Model runner time per engine step.",
                                      ["model_name"], buckets=_STEP_BUCKETS, registry=self.registry).labels(model_name)  # fmt: skip
        self.step_tokens = Histogram(PREFIX + "iteration_tokens", "Tokens scheduled per engine step (prefill + decode).",
                                     ["model_name"], buckets=length_buckets(max_model_len), registry=self.registry).labels(model_name)  # fmt: skip
        # The scheduler sizes every step by a cost model's prediction (scheduler/step_cost.py): when it
        # drifts from what steps take, the step-time target no longer holds (servelm diagnose shows it).
        self.step_prediction_ratio = Histogram(
            PREFIX + "step_time_prediction_ratio",
            "Engine step time measured / predicted by the scheduler's step-cost model (1: exact), by kind of step: "
            "decode (no prompt work), shallow or deep (a prompt chunk after 1,024+ tokens of its prompt).",
            ["model_name", "kind"], buckets=_PREDICTION_RATIO_BUCKETS, registry=self.registry)  # fmt: skip
        self.grammar_mask_seconds = Histogram(
            PREFIX + "grammar_mask_seconds", "Structured outputs: time to fill one step's token masks (all its "
            "constrained requests), on a thread beside the forward (structured/masks.py).", ["model_name"],
            buckets=_MASK_BUCKETS, registry=self.registry).labels(model_name)  # fmt: skip
        self.loop_lag = Histogram(PREFIX + "api_event_loop_lag_seconds",
                                  "How late the API event loop ran a timer that was due (obs.loop_lag): how long every "
                                  "ready callback (SSE writes, request parsing, engine outputs) waited behind others.",
                                  ["model_name"], buckets=_LOOP_LAG_BUCKETS, registry=self.registry).labels(model_name)  # fmt: skip

    def observe_steps(self, stats: CoreStats) -> None:
        for num_tokens, seconds in stats.recent_steps:
            self.step_tokens.observe(num_tokens)
            self.step_seconds.observe(seconds)
        for kind, predicted_s, measured_s in stats.recent_predictions:
            self.step_prediction_ratio.labels(self.model_name, kind).observe(measured_s / predicted_s)
        for seconds in stats.recent_mask_fills:
            self.grammar_mask_seconds.observe(seconds)

    def observe_engine_restart(self) -> None:
        self.engine_restarts.inc()

    def observe_token_gap(self, slo: RequestSlo, gap_s: float) -> None:
        self._itl_by_class.observe(slo, gap_s)

    def observe_output_backlog(self, slo: RequestSlo, num_outputs: int) -> None:
        self._backlog_by_class.observe(slo, num_outputs)

    def observe_loop_lag(self, lag_s: float) -> None:
        self.loop_lag.observe(lag_s)

    def observe_ttft(self, slo: RequestSlo, breakdown: TTFTBreakdown) -> None:
        labels = (self.model_name, slo.tenant, slo.slo_class)
        self.ttft.labels(*labels).observe(max(breakdown.ttft, 0.0))
        for name in TTFTBreakdown.COMPONENTS:
            self.ttft_component.labels(*labels, name).observe(max(getattr(breakdown, name), 0.0))

    def observe_finished(self, request: FinishedRequest) -> None:
        labels = (self.model_name, request.slo.tenant, request.slo.slo_class)
        self.request_success.labels(*labels, request.finish_reason).inc()
        if slo_met(request):
            self.request_slo_met.labels(*labels).inc()
        self.prompt_tokens.labels(*labels).inc(request.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(request.num_generation_tokens)
        self.prompt_len.labels(*labels).observe(request.num_prompt_tokens)
        self.generation_len.labels(*labels).observe(request.num_generation_tokens)
        self.e2e.labels(*labels).observe(max(request.e2e_s, 0.0))
        stamps = _first_stamps(request.events)
        arrived, scheduled = stamps.get(EventType.ARRIVED), stamps.get(EventType.SCHEDULED)
        first_token, finished = stamps.get(EventType.FIRST_TOKEN), stamps.get(EventType.FINISHED)
        if arrived is not None and scheduled is not None:
            self.queue.labels(*labels).observe(max(scheduled - arrived, 0.0))
        if scheduled is not None and first_token is not None:
            self.prefill.labels(*labels).observe(max(first_token - scheduled, 0.0))
        for start, end in kv_load_spans(request.events):
            self.kv_load.labels(*labels).observe(max(end - start, 0.0))
        for start, end in kv_load_spans(request.events, PULL_EVENTS):
            self.kv_pull.labels(*labels).observe(max(end - start, 0.0))
        if first_token is not None and finished is not None:
            decode = max(finished - first_token, 0.0)
            self.decode.labels(*labels).observe(decode)
            if request.num_generation_tokens > 1:
                self.tpot.labels(*labels).observe(decode / (request.num_generation_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def starting_metrics(model_name: str) -> bytes:
    """What /metrics answers while the engine starts: the start-up family, with no phase yet."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StartupCollector(model_name, {}))
    return generate_latest(registry)


class StartupCollector(Collector):
    """`startup_seconds{model_name, phase}`: seconds each start-up phase took (a phase run twice, e.g.
    a target's and a draft's load, summed); only the phases this start ran, in PHASES order."""

    def __init__(self, model_name: str, seconds_by_phase: Mapping[str, float]) -> None:
        self.model_name = model_name
        self.seconds_by_phase = dict(seconds_by_phase)

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily(PREFIX + "startup_seconds", "Seconds the last start-up spent in each phase "
                                  "(fetch, verify, load, kernel_build, warmup, kv_sizing); phases may overlap.",
                                  labels=["model_name", "phase"])  # fmt: skip
        for phase in PHASES:
            if phase in self.seconds_by_phase:
                gauge.add_metric([self.model_name, phase], self.seconds_by_phase[phase])
        yield gauge


class _ByClass:
    """A (model_name, tenant, slo_class) histogram's children, looked up once per tenant and class."""

    def __init__(self, family: Histogram, model_name: str) -> None:
        self.family = family
        self.model_name = model_name
        self.children: dict[tuple[str, str], Histogram] = {}

    def observe(self, slo: RequestSlo, value: float) -> None:
        key = (slo.tenant, slo.slo_class)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self.family.labels(self.model_name, *key)
        child.observe(value)


def _first_stamps(events: list[RequestEvent]) -> dict[EventType, float]:
    stamps: dict[EventType, float] = {}
    for event in events:
        stamps.setdefault(event.type, event.timestamp)
    return stamps


class _CoreCollector(Collector):
    """Gauges and cumulative counters straight from the latest CoreStats, read at scrape time."""

    def __init__(
        self,
        model_name: str,
        core_stats: Callable[[], CoreStats],
        num_blocks: int,
        num_in_api: Callable[[], int],
        num_outputs_queued: Callable[[], int],
    ) -> None:
        self.model_name = model_name
        self.core_stats = core_stats
        self.num_blocks = num_blocks
        self.num_in_api = num_in_api
        self.num_outputs_queued = num_outputs_queued

    def collect(self) -> Iterable[Metric]:
        stats = self.core_stats()
        gauges = (
            ("num_requests_running", "Requests in the engine's running set.", stats.num_running),
            ("num_requests_waiting", "Requests in the engine's waiting queue.", stats.num_waiting),
            ("num_requests_prefilling", "Running prompts mid-prefill (partial prefills).", stats.num_prefilling),
            ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", stats.kv_usage),
            ("kv_cache_used_blocks", "KV blocks held by requests.", stats.num_used_blocks),
            ("kv_cache_total_blocks", "KV blocks in the pool.", self.num_blocks),
            ("step_time_target_seconds", "The step-time target every step is sized to (0: none; "
             "--max-step-ms, by default chosen at start-up).", stats.step_target_s),
            ("num_requests_in_api", "Engine requests the API process has in flight.", self.num_in_api()),
            (
                "num_outputs_queued_in_api",
                "Engine outputs the API process received that their streams have not taken "
                "yet, summed over streams: near 0 while clients read; grows while one does not.",
                self.num_outputs_queued(),
            ),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(value))
            yield gauge
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hits),
            ("prefix_cache_evicted_misses", "Prompt tokens not found in the prefix cache because their blocks "
             f"had been evicted (among the last pool-size evictions, at most {MAX_GHOSTS:,}): recomputed for want "
             "of KV memory.", stats.prefix_evicted_misses),
            ("num_preemptions", "Preemptions (a running request lost its blocks).", stats.num_preemptions),
            ("spec_decode_num_drafts", "Speculative decoding: request-steps that verified draft tokens.",
             stats.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.", stats.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
             stats.spec_num_accepted_tokens),
            ("structured_output_requests", "Requests that asked for structured outputs (a schema, regex, choice "
             "or grammar).", stats.structured_requests),
            ("grammar_compiles", "Structured-output grammars compiled in the engine (compiled ones are cached "
             "by spec: a repeat is not counted).", stats.grammar_compiles),
            ("grammar_compile_seconds", "Seconds the engine spent compiling structured-output grammars, off "
             "the step loop.", stats.grammar_compile_seconds),
        )  # fmt: skip
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(value))
            yield counter
        evicted = CounterMetricFamily(PREFIX + "prefix_cache_evicted_blocks", "Hashed blocks evicted from the "
                                      "prefix cache, by the tenant whose request cached them.", labels=["model_name", "tenant"])  # fmt: skip
        for tenant, count in sorted(stats.prefix_evictions_by_tenant.items()):
            evicted.add_metric([self.model_name, tenant], float(count))
        yield evicted
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Speculative "
                                           "decoding: draft tokens accepted, by draft position (0 = the first).",
                                           labels=["model_name", "position"])  # fmt: skip
        for position, count in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], float(count))
        yield per_position
        yield from self._tier_metrics(stats.tiers)

    def _tier_metrics(self, tiers: TierStats) -> Iterable[Metric]:
        """KV tiers beyond the pool, by medium (vLLM's external_prefix_cache_* pair per tier)."""
        by_medium: tuple[tuple[str, str, dict[str, int], type[CounterMetricFamily | GaugeMetricFamily]], ...] = (
            ("external_prefix_cache_queries", "Prompt tokens looked up in a KV tier beyond the pool (after the pool "
             "and nearer tiers missed).", tiers.queries, CounterMetricFamily),
            ("external_prefix_cache_hits", "Prompt tokens loaded from a KV tier beyond the pool.", tiers.hits,
             CounterMetricFamily),
            ("kv_tier_usage_bytes", "Bytes of KV blocks a tier holds.", tiers.used_bytes, GaugeMetricFamily),
            ("kv_tier_capacity_bytes", "Bytes of KV blocks a tier may hold.", tiers.capacity_bytes, GaugeMetricFamily),
        )  # fmt: skip
        for name, doc, values, family_type in by_medium:
            family = family_type(PREFIX + name, doc, labels=["model_name", "medium"])
            for medium, value in sorted(values.items()):
                family.add_metric([self.model_name, medium], float(value))
            yield family
        moved = CounterMetricFamily(PREFIX + "kv_transfer_bytes", "KV bytes moved between the pool and a tier: "
                                    "load (into the pool) or save (out of it).", labels=["model_name", "direction", "medium"])  # fmt: skip
        for direction, values in (("load", tiers.loaded_bytes), ("save", tiers.saved_bytes)):
            for medium, value in sorted(values.items()):
                moved.add_metric([self.model_name, direction, medium], float(value))
        yield moved
        single: tuple[tuple[str, str, float, type[CounterMetricFamily | GaugeMetricFamily]], ...] = (
            ("kv_load_failures", "KV loads that stopped short (timed out, or a block missing or corrupt); the rest "
             "of the prompt was computed.", tiers.failed_loads, CounterMetricFamily),
            ("num_requests_loading_kv", "Requests waiting for their prefix's KV to load from a tier.",
             tiers.num_loading, GaugeMetricFamily),
            ("num_kv_pulls_in_flight", "Disaggregation, decode worker: requests pulling their prompt's KV from a "
             "prefill worker.", tiers.num_pulling, GaugeMetricFamily),
            ("num_kv_exports_held", "Disaggregation, prefill worker: prompts whose KV is held for a decode "
             "worker's pull.", tiers.num_exports, GaugeMetricFamily),
        )  # fmt: skip
        for name, doc, amount, family_type in single:
            family = family_type(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(amount))
            yield family
