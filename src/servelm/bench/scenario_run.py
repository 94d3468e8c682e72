"""Runs one scenario (bench.scenarios): both windows against one server, then `servelm diagnose`.

    [start the server]  ─▶ [capacity: the baseline's traffic, closed loop ─▶ DIR/capacity; rate = share of it]
                        ─▶ baseline: prepare ─▶ WindowRecorder ⟨ bench run ⟩ ─▶ DIR/baseline
                        ─▶ today:    [proxy] prepare ─▶ WindowRecorder ⟨ bench run ⟩ ─▶ DIR/today
                        ─▶ diagnose(DIR/baseline, DIR/today) ─▶ DIR/diagnosis.json, DIR/diagnosis.txt

The bench run is synchronous (it owns an event loop), so it runs in a worker thread while the
recorder samples /metrics and the delay proxy, when there is one, forwards bytes on this loop.
The recorder always scrapes the server itself, never through the proxy. The run's own files
(run.json, summary.md) go to DIR/<window>/bench/; bench.json is the same report, for diagnose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from servelm.bench.delay_proxy import DelayProxy
from servelm.bench.execute import BenchConfig, Load, prepare, run_once
from servelm.bench.scenarios import Scenario, ScenarioSize, WindowLoad
from servelm.diagnose.capture import WindowRecorder
from servelm.diagnose.causes import diagnose
from servelm.diagnose.report import to_json, to_text
from servelm.diagnose.sources import load_signals

# Starts `servelm serve --model MODEL ARGS...` (None: the default model) and yields its base URL
# while it runs. Injected by the caller: bench/ talks HTTP only and does not import the server.
ServerLauncher = Callable[[str | None, list[str]], AbstractContextManager[str]]

WINDOWS = ("baseline", "today")
PROBE = "capacity"
PROBE_LIMIT_S = 900.0  # the capacity probe's longest run (it ends with its requests; this bounds a stuck one)


class CapacityProbeFailed(RuntimeError):
    """The server completed none of the probe's requests: there is no rate to size the windows by."""


@dataclass(frozen=True)
class ScenarioOptions:
    out_dir: Path
    quick: bool = False
    base_url: str | None = None  # a running server (its flags are then the caller's business)
    model: str | None = None  # for a server started here (None: the default model)
    tokenizer: str | None = None
    api_key: str | None = None
    seed: int = 0
    rate: float | None = None  # overrides the size's rate
    seconds: float | None = None  # ... and window length
    sessions: int | None = None  # conversations open at once (session profiles; None: the profile's)
    progress: bool = True


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    expected_cause: str
    top_cause: str | None  # None: diagnose failed (see error)
    out_dir: Path
    error: str | None = None
    rate: float | None = None  # the windows' requests/s
    capacity: float | None = None  # requests/s the probe measured (None: the size's fixed rate)

    @property
    def ok(self) -> bool:
        return self.top_cause == self.expected_cause

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "expected_cause": self.expected_cause, "top_cause": self.top_cause,
                "ok": self.ok, "out_dir": str(self.out_dir), "error": self.error, "rate": self.rate,
                "capacity": self.capacity}  # fmt: skip


def bench_config(load: WindowLoad, size: ScenarioSize, base_url: str, out_dir: Path, options: ScenarioOptions) -> BenchConfig:
    """The `servelm bench run` configuration of one window."""
    return BenchConfig(
        base_url=base_url, out_dir=out_dir, profile=load.profile, weights=dict(load.weights), seed=options.seed,
        num_requests=size.num_requests, duration_s=size.seconds + size.drain_s, prompt_scale=size.length_scale,
        max_output_tokens=size.max_output_tokens, api_key=options.api_key, tokenizer=options.tokenizer,
        endpoint=load.endpoint, document_tokens=load.document_tokens, slow_readers=load.slow_readers,
        read_delay_ms=load.read_delay_ms, read_bytes=load.read_bytes, slow_reader_logprobs=load.slow_reader_logprobs,
        sessions=options.sessions, progress=options.progress, plots=False,
    )  # fmt: skip


async def run_window(label: str, load: WindowLoad, size: ScenarioSize, server_url: str, options: ScenarioOptions) -> Path:
    """One window: the load at `size.rate`, recorded into out_dir/label; returns that directory."""
    window_dir = options.out_dir / label
    async with contextlib.AsyncExitStack() as stack:
        client_url = server_url
        if load.network is not None:
            parts = urlsplit(server_url)
            proxy = DelayProxy(parts.hostname or "127.0.0.1", parts.port or 80, load.network, seed=options.seed)
            client_url = (await stack.enter_async_context(proxy)).url
        config = bench_config(load, size, client_url, window_dir / "bench", options)
        target = await asyncio.to_thread(prepare, config)  # the tokenizer loads before the window opens
        recorder = await stack.enter_async_context(WindowRecorder(server_url, window_dir, label, options.api_key))
        # The same lengths and arrival pattern in both windows, with fresh tokens in the second: else
        # "today" re-sends the baseline's prompts and hits the prefix cache the baseline filled.
        salt = WINDOWS.index(label)
        report = await asyncio.to_thread(run_once, target, config, Load("rate", size.rate), config.out_dir, salt)
        recorder.write_bench_report(report)
    return window_dir


def measure_capacity(load: WindowLoad, size: ScenarioSize, server_url: str, options: ScenarioOptions) -> float:
    """Requests/s the server completes with `load`'s traffic (the baseline's): size.probe_requests
    of them, closed loop at size.probe_concurrency in flight, recorded in DIR/capacity. A lower
    bound where more in flight would batch better (a GPU): the windows err toward room. Other
    tokens than either window's (salt), so that it warms neither's prefixes; it does warm the
    server, which the baseline would otherwise pay for in its first requests."""
    config = replace(bench_config(load, size, server_url, options.out_dir / PROBE, options),
                     num_requests=size.probe_requests, duration_s=PROBE_LIMIT_S)  # fmt: skip
    target = prepare(config)
    report = run_once(target, config, Load("concurrency", size.probe_concurrency), config.out_dir, salt=len(WINDOWS))
    overall = report["summary"]["overall"]
    if not overall["num_ok"]:
        raise CapacityProbeFailed(f"the capacity probe completed none of its {size.probe_requests} requests "
                                  f"(see {config.out_dir})")  # fmt: skip
    return float(overall["request_throughput"])  # successes per second: a failed request adds nothing


def run_scenario(scenario: Scenario, options: ScenarioOptions, launcher: ServerLauncher | None = None) -> ScenarioResult:
    """Both windows (on `options.base_url`, or on a server `launcher` starts with the scenario's
    flags), then the diagnosis. Writes everything under options.out_dir (see module doc). A size
    with a utilization first measures the server's capacity for the baseline (unless
    options.rate fixes the rate)."""
    size = scenario.size(options.quick)
    if options.rate is not None:
        size = replace(size, rate=options.rate, utilization=None)
    if options.seconds is not None:
        size = replace(size, seconds=options.seconds)
    if options.base_url is None and options.tokenizer is None:
        options = replace(options, tokenizer=options.model)  # the server started here serves that model
    options.out_dir.mkdir(parents=True, exist_ok=True)
    capacity: float | None = None
    _write_description(scenario, size, options, capacity)
    with _server(scenario, options, launcher) as server_url:
        if size.utilization is not None:
            try:
                capacity = measure_capacity(scenario.baseline, size, server_url, options)
            except CapacityProbeFailed as exc:  # the suite goes on to the next scenario
                return ScenarioResult(scenario.name, scenario.expected_cause, None, options.out_dir, str(exc))
            size = size.at_capacity(capacity)
            _write_description(scenario, size, options, capacity)
        for label, load in zip(WINDOWS, (scenario.baseline, scenario.today), strict=True):
            asyncio.run(run_window(label, load, size, server_url, options))
    return replace(diagnose_windows(scenario, options.out_dir), rate=size.rate, capacity=capacity)


def diagnose_windows(scenario: Scenario, out_dir: Path) -> ScenarioResult:
    """`servelm diagnose DIR/baseline DIR/today`, saved as DIR/diagnosis.json and .txt."""
    try:
        diagnosis = diagnose(load_signals(out_dir / "baseline"), load_signals(out_dir / "today"))
    except ValueError as exc:  # a window diagnose cannot read: the windows stay for a person to look at
        return ScenarioResult(scenario.name, scenario.expected_cause, None, out_dir, str(exc))
    (out_dir / "diagnosis.json").write_text(json.dumps(to_json(diagnosis), indent=1))
    (out_dir / "diagnosis.txt").write_text(to_text(diagnosis))
    return ScenarioResult(scenario.name, scenario.expected_cause, diagnosis.top_cause, out_dir)


def _write_description(scenario: Scenario, size: ScenarioSize, options: ScenarioOptions, capacity: float | None) -> None:
    described = {**_describe(scenario, size, options), "capacity_req_s": capacity}
    (options.out_dir / "scenario.json").write_text(json.dumps(described, indent=1, default=str))


@contextlib.contextmanager
def _server(scenario: Scenario, options: ScenarioOptions, launcher: ServerLauncher | None) -> Iterator[str]:
    if options.base_url is not None:
        yield options.base_url.rstrip("/")
        return
    if launcher is None:
        raise ValueError(f"scenario {scenario.name}: give --base-url, or a launcher to start a server")
    with launcher(options.model, list(scenario.args(options.quick))) as url:
        yield url


def _describe(scenario: Scenario, size: ScenarioSize, options: ScenarioOptions) -> dict[str, Any]:
    return {
        "scenario": scenario.name,
        "expected_cause": scenario.expected_cause,
        "description": scenario.description,
        "size": {**size.__dict__, "num_requests": size.num_requests, "quick": options.quick,
                 "sessions": options.sessions},
        "server": options.base_url or {"model": options.model or "default", "args": list(scenario.args(options.quick))},
        "baseline": scenario.baseline.__dict__,
        "today": scenario.today.__dict__,
    }
