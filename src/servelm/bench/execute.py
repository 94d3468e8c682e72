"""One benchmark run, end to end: probe the server, build the workload, send it, write the reports.

    probe /v1/models (+ /metrics) ─▶ tokenizer ─▶ workload (profile or trace) + arrival times
        ─▶ counters before ─▶ run ─▶ counters after ─▶ summary ─▶ run.json, summary.md, *.png

`BenchConfig` is everything the command line decides; `Target` is what we learned about the
server and built once (the tokenizer is slow to load), shared by every step of a sweep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servelm.bench.arrivals import ArrivalConfig, arrival_times, assign_arrivals
from servelm.bench.client import ClientConfig, RequestRecord
from servelm.bench.profiles import build_workload, load_sharegpt_lengths
from servelm.bench.report import run_markdown, run_report, write_json
from servelm.bench.runner import RunLimits, RunResult, run_workload
from servelm.bench.server_info import (
    ServerInfo,
    counter_delta,
    probe_server,
    scrape_counters,
)
from servelm.bench.slow_reader import SlowReading, mark_slow_readers
from servelm.bench.stats import summarize
from servelm.bench.tokens import TokenSource, resolve_token_source
from servelm.bench.trace import TraceReplay, load_trace
from servelm.bench.workload import DEFAULT_SLOS, SLO, LengthLimits, WorkloadRequest

logger = logging.getLogger(__name__)
FALLBACK_CONTEXT = 4096  # when the server does not say its context window and --max-context is not given


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    out_dir: Path
    profile: str = "mixed"
    weights: dict[str, float] = field(
        default_factory=lambda: {"voice": 0.4, "code": 0.3, "analytics": 0.2, "chat": 0.1}
    )
    seed: int = 0
    num_requests: int = 100
    duration_s: float = 600.0
    arrival: str = "poisson"  # poisson | gamma
    burstiness: float = 1.0
    trace: Path | None = None
    time_scale: float = 1.0
    trace_time_unit_s: float = 0.001
    trace_block_size: int = 512
    slos: dict[str, SLO] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    prompt_scale: float = 1.0
    max_output_tokens: int | None = None
    max_context: int | None = None
    api_key: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)  # per traffic class (--api-keys); api_key for the rest
    model: str | None = None  # the `model` field; default: the server's first model
    tokenizer: str | None = None
    endpoint: str = "completions"
    temperature: float = 0.0
    ignore_eos: bool = True
    priority: str = "auto"  # auto (servelm only) | on | off
    timeline: str = "auto"
    request_timeout_s: float = 600.0
    chat_dataset: Path | None = None
    progress: bool = True
    plots: bool = True
    document_tokens: tuple[int, int] | None = None  # analytics documents' length range (default 500-2000)
    voice_output_tokens: tuple[int, int] | None = None  # voice turns' output length range (default 20-80)
    sessions: int | None = None  # conversations open at once in the voice and longchat profiles (default 4)
    slow_readers: float = 0.0  # fraction of requests whose client reads the stream slowly
    read_delay_ms: float = 200.0  # ... busy this long after each read of at most read_bytes
    read_bytes: int = 1024
    slow_reader_logprobs: int = 0  # top logprobs those requests ask for (heavier chunks)

    def __post_init__(self) -> None:
        if not 0.0 <= self.slow_readers <= 1.0:
            raise ValueError(f"slow_readers is a fraction in [0, 1], got {self.slow_readers}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["slos"] = {name: slo.to_dict() for name, slo in self.slos.items()}
        # Keys are secrets and reports get shared: say which were set, never what they are.
        out["api_key"] = "(set)" if self.api_key else None
        out["api_keys"] = dict.fromkeys(self.api_keys, "(set)")
        return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


@dataclass(frozen=True)
class Load:
    """One load level: an open-loop rate, a closed-loop concurrency, or the trace's own times."""

    kind: str  # rate | concurrency | trace
    value: float | None = None

    def describe(self, config: BenchConfig) -> str:
        if self.kind == "rate":
            shape = f", burstiness {config.burstiness:g}" if config.arrival == "gamma" else ""
            return f"{config.arrival} arrivals at {self.value:g} req/s{shape}"
        if self.kind == "concurrency":
            return f"closed loop at concurrency {self.value:g}"
        return f"trace {config.trace} at time scale {config.time_scale:g}"


@dataclass
class Target:
    server: ServerInfo
    tokens: TokenSource
    limits: LengthLimits
    client: ClientConfig
    chat_lengths: list[tuple[int, int]] | None = None


def _switch(mode: str, default: bool) -> bool:
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"expected auto, on or off, got {mode!r}")
    return default if mode == "auto" else mode == "on"


def prepare(config: BenchConfig) -> Target:
    # Probe, warm-up and classes without their own key: --api-key, else the first per-class key.
    default_key = config.api_key or next(iter(config.api_keys.values()), None)
    server = probe_server(config.base_url, default_key)
    tokens = resolve_token_source(config.tokenizer, server.model_id, server.model_root)
    context = config.max_context or server.max_model_len or FALLBACK_CONTEXT
    limits = LengthLimits(context, config.prompt_scale, config.max_output_tokens)
    client = ClientConfig(
        base_url=config.base_url,
        model=config.model or server.model_id,
        endpoint=config.endpoint,
        temperature=config.temperature,
        ignore_eos=config.ignore_eos,
        send_priority=_switch(config.priority, server.is_servelm),
        want_timeline=_switch(config.timeline, server.is_servelm),
        api_key=default_key,
        request_timeout_s=config.request_timeout_s,
        api_keys=config.api_keys,
        slow_reading=SlowReading(config.read_delay_ms / 1000.0, config.read_bytes) if config.slow_readers else None,
        slow_reader_logprobs=config.slow_reader_logprobs,
    )
    chat_lengths = load_sharegpt_lengths(config.chat_dataset, tokens, seed=config.seed) if config.chat_dataset else None
    return Target(server, tokens, limits, client, chat_lengths)


def build_requests(target: Target, config: BenchConfig, load: Load, salt: int = 0) -> list[WorkloadRequest]:
    return workload_requests(target.tokens, target.limits, config, load, salt, target.chat_lengths)


def workload_requests(tokens: TokenSource, limits: LengthLimits, config: BenchConfig, load: Load, salt: int = 0,
                      chat_lengths: list[tuple[int, int]] | None = None) -> list[WorkloadRequest]:  # fmt: skip
    """The run's requests with their arrival times (none: closed loop), from the profile or the
    trace; no server needed (`servelm simulate` replays the same)."""
    if load.kind == "trace":
        if config.trace is None:
            raise ValueError("a trace load needs --trace")
        entries = load_trace(config.trace, max_entries=config.num_requests)
        replay = TraceReplay(tokens, limits, config.seed, config.trace_block_size, config.time_scale,
                             config.trace_time_unit_s, salt)  # fmt: skip
        return replay.workload(entries)
    requests = build_workload(config.profile, config.num_requests, tokens, limits, config.seed,
                              config.weights, chat_lengths, salt, config.document_tokens,
                              config.voice_output_tokens, config.sessions)  # fmt: skip
    mark_slow_readers(requests, config.slow_readers, config.seed)
    if load.kind == "concurrency":
        return assign_arrivals(requests, None)
    arrivals = ArrivalConfig(config.arrival, float(load.value or 0.0), config.burstiness)
    return assign_arrivals(requests, arrival_times(arrivals, len(requests), config.seed))


def run_once(target: Target, config: BenchConfig, load: Load, out_dir: Path, salt: int = 0) -> dict[str, Any]:
    """Build, send, measure, write run.json / summary.md / plots into out_dir; returns the report."""
    requests = build_requests(target, config, load, salt)
    concurrency = int(load.value or 1) if load.kind == "concurrency" else None
    limits = RunLimits(duration_s=config.duration_s, concurrency=concurrency, progress=config.progress)
    before: dict[str, float] | None = None

    def snapshot() -> None:  # after the runner's warm-up request: the delta counts the workload alone
        nonlocal before
        before = scrape_counters(config.base_url, target.client.api_key) if target.server.has_metrics else None

    result: RunResult = asyncio.run(run_workload(requests, target.client, limits, target.tokens, after_warm_up=snapshot))
    after = scrape_counters(config.base_url, target.client.api_key) if target.server.has_metrics else None
    summary = summarize(result.records, config.slos, result.duration_s)
    described = {"load": load.describe(config), "load_kind": load.kind, "load_value": load.value, "salt": salt}
    server = {
        **target.server.to_dict(),
        "tokenizer": target.tokens.name,
        "metrics_delta": counter_delta(before, after),  # the server's own count of this run
        "sent_priority": target.client.send_priority,
        "asked_timeline": target.client.want_timeline,
    }
    outcome = {
        "duration_s": result.duration_s,
        "started_unix": result.started_unix,
        "interrupted": result.interrupted,
        "hit_time_limit": result.hit_time_limit,
        "num_not_sent": result.num_not_sent,
    }
    report = run_report(
        config={**config.to_dict(), **described}, server=server, slos=config.slos, result=outcome, summary=summary,
        records=result.records,
    )  # fmt: skip
    write_run(report, result.records, out_dir, config.plots)
    return report


def write_run(report: dict[str, Any], records: list[RequestRecord], out_dir: Path, plots: bool,
              markdown: Callable[[dict[str, Any], list[Path]], str] = run_markdown) -> None:  # fmt: skip
    """run.json, the plots (if asked) and summary.md (`markdown` of the report and the plots) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(report, out_dir / "run.json")
    made: list[Path] = []
    if plots:
        # Imported here: runs without plots (the scenarios) need no matplotlib, which the GPU
        # device image lacks (benchmarks/gpu_scenario.sh).
        from servelm.bench.plots import plot_run

        made = plot_run(records, report["summary"], out_dir)
    (out_dir / "summary.md").write_text(markdown(report, made))


def load_of(args: Any) -> Load:
    """The load `bench run`'s flags ask for: --trace, --concurrency, else --rate (default 1 req/s)."""
    if args.trace is not None:
        return Load("trace")
    if args.concurrency is not None:
        return Load("concurrency", float(args.concurrency))
    return Load("rate", args.rate if args.rate is not None else 1.0)
