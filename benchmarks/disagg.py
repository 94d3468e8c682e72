"""Prefill/decode disaggregation against aggregated replicas, equal resources, same requests (issue 14).

    python benchmarks/disagg.py --out /tmp/disagg-bench                  # the real sizes (see below)
    python benchmarks/disagg.py --out /tmp/disagg-smoke --num-requests 6 --rate 0.3 --c1-requests 3 \\
        --voice-output-tokens 20-40 --document-tokens 600-900 --bandwidth-blocks 16

Systems, each a `servelm cluster` of the default model on this machine, started fresh:
    pd   1 prefill worker + 1 decode worker (one torch thread each) and the kv router, which
         splits a request only when the decode worker would compute >= 512 uncached prompt
         tokens and the prefill worker is not saturated (router/disagg.py, its defaults)
    agg  2 aggregated replicas (one torch thread each, KV events on) and the kv router

Phase 1, the issue's workload: `servelm bench run` through the router, open-loop Poisson
arrivals, one seed, the mixed profile of voice-bot streams (short turns of multi-turn
sessions, outputs `--voice-output-tokens`, default 200-300: long spoken answers) and
analytics documents (`--document-tokens`, default 2000-4000 tokens, outputs 10-100: the
profile's own). Voice SLO: TBT only, each stream's p90 gap <= `--voice-tbt-slo` (0.2 s): a
voice bot speaks ~3 tokens/s, so a token every 0.2 s (5/s) keeps text-to-speech ahead of the
voice with a margin for jitter, while a stream stuck behind a prefill chunk (seconds here)
stalls the voice. A voice TTFT bound is left out on purpose: on this CPU a turn's uncached
prompt (its user text and the previous reply, ~250-500 tokens) takes ~1-2 s to compute on
either system, so a TTFT bound would judge prefill speed, not the interference this measures.

How the load was chosen (before measuring, not tuned to the result): a 3k-token prefill of
the default model takes ~10-15 s on one thread here, a 250-token voice stream ~8-10 s. With
`--weights voice=0.6,analytics=0.4` at `--rate 0.15` req/s, analytics documents arrive at
0.06/s, i.e. ~0.7 s of prefill per second: the pd prefill worker is ~70 % busy (loaded, not
saturated), agg's two replicas ~35 % each on prefill on top of their voice streams. Voice
turns arrive at 0.09/s x 250 tokens ~ 23 tokens/s of decode, which the pd decode worker
batches (the voice profile keeps at most 4 sessions open; a session's next turn waits for
the previous one). 50 requests at 0.15/s is ~330 s of arrivals, plus the drain: each
system's phase 1 stays under ~8 minutes (`--duration-s` caps it at 600 s).

Phase 2: concurrency 1, short prompts only (the voice profile, its default 20-80 outputs,
`--c1-requests` turns, another seed so no prompt is in cache from phase 1): TTFT p50, pd vs
agg (the decider must keep these local: they are short).

Phase 3: benchmarks/kv_transfer_bandwidth.py in the same run (pure pull GB/s over tcp and
ipc against memcpy GB/s), next to phase 1's end-to-end figure: bytes the decode worker
pulled / its total pull time, which includes the remote prefill (a pull streams blocks as
they are computed), so it is far below the link's bandwidth by construction.

Targets (the issue's): pd's voice TBT p99 >= 3x better (agg / pd >= 3), voice goodput
>= 1.5x (pd / agg), total output throughput >= 0.8x (pd / agg); phase 2: pd's TTFT p50 at
most 10 % above agg's. Writes OUT/disagg.json and OUT/disagg.md (the table, also printed),
each bench run's reports under OUT/SYSTEM/PHASE/, cluster logs under OUT/SYSTEM/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servelm.ports import free_port_range

HERE = Path(__file__).resolve().parent
SYSTEMS = ("pd", "agg")
BLOCK_SIZE = 16
READY_LINE = "Ctrl-C stops everything"  # what `servelm cluster` prints once every process is healthy
# Ports of one cluster, as offsets from a free range: the router, the workers' HTTP, their KV
# events (two ports each: PUB and snapshot), the prefill worker's transfer server.
ROUTER, HTTP, EVENTS, TRANSFER, NUM_PORTS = 0, 1, 10, 20, 24


def cluster_config(system: str, base_port: int) -> str:
    """The `servelm cluster` YAML of one system on ports from `base_port` (NUM_PORTS of them)."""
    pool = "num_threads: 1"
    if system == "pd":
        pools = (
            f"prefill: {{count: 1, {pool}, base_port: {base_port + HTTP}, kv_events_base_port: {base_port + EVENTS}, "
            f"transfer_base_port: {base_port + TRANSFER}}}\n"
            f"decode: {{count: 1, {pool}, base_port: {base_port + HTTP + 1}, "
            f"kv_events_base_port: {base_port + EVENTS + 2}}}\n"
        )
    elif system == "agg":
        pools = f"replicas: {{count: 2, {pool}, base_port: {base_port + HTTP}, kv_events_base_port: {base_port + EVENTS}}}\n"
    else:
        raise ValueError(f"unknown system {system!r}: expected one of {SYSTEMS}")
    return f"block_size: {BLOCK_SIZE}\n{pools}router: {{port: {base_port + ROUTER}, policy: kv}}\n"


@contextlib.contextmanager
def running_cluster(system: str, out: Path, startup_timeout_s: float = 300.0) -> Iterator[dict[str, str]]:
    """`servelm cluster` of `system`, healthy: yields {process name: URL}; SIGINT (its Ctrl-C) on exit."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "cluster.yaml"
    config.write_text(cluster_config(system, free_port_range(NUM_PORTS)))
    command = [sys.executable, "-m", "servelm.cli", "cluster", str(config), "--log-dir", str(out / "logs")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not any(READY_LINE in line for line in lines):
            line = process.stdout.readline()
            if not line and process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{system} cluster did not start:\n{''.join(lines)}\nlogs in {out / 'logs'}")
            lines.append(line)
        yield cluster_urls(lines)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def cluster_urls(lines: list[str]) -> dict[str, str]:
    """`servelm cluster`'s "NAME  URL" lines (its other output ignored) as {name: url}."""
    pairs = (line.split() for line in lines)
    return {p[0]: p[1] for p in pairs if len(p) == 2 and p[1].startswith("http://")}


def run_bench(base_url: str, out: Path, bench_args: list[str]) -> dict[str, Any]:
    """One `servelm bench run` against `base_url`; its run.json."""
    command = [sys.executable, "-m", "servelm.cli", "bench", "run", "--base-url", base_url, "--out", str(out),
               "--no-progress", "--no-plots", *bench_args]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads((out / "run.json").read_text())


def phase1_args(args: argparse.Namespace) -> list[str]:
    return [
        "--profile", "mixed", "--weights", args.weights, "--voice-output-tokens", args.voice_output_tokens,
        "--document-tokens", args.document_tokens, "--rate", str(args.rate), "--num-requests", str(args.num_requests),
        "--seed", str(args.seed), "--duration-s", str(args.duration_s), "--slo", f"voice:tbt={args.voice_tbt_slo}",
    ]  # fmt: skip


def phase2_args(args: argparse.Namespace) -> list[str]:
    return ["--profile", "voice", "--concurrency", "1", "--num-requests", str(args.c1_requests),
            "--seed", str(args.seed + 1), "--slo", f"voice:tbt={args.voice_tbt_slo}"]  # fmt: skip


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `url`/metrics, keyed by (name, sorted labels without model_name)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = samples.get((sample.name, labels), 0.0) + sample.value
    return samples


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """after - before of the samples named `name` whose labels include `labels` (summed)."""

    def total(samples: Samples) -> float:
        wanted = set(labels.items())
        return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))

    return total(after) - total(before)


def decisions(before: Samples, after: Samples) -> dict[str, int]:
    """The router's split decisions during a phase: {"decision/reason": count}, zeros left out."""
    out: dict[str, int] = {}
    for (name, labels), value in after.items():
        if name == "servelm:router_disagg_decisions_total":
            count = int(round(value - before.get((name, labels), 0.0)))
            if count:
                label = dict(labels)
                out[f"{label['decision']}/{label['reason']}"] = count
    return out


@dataclass
class Pulls:
    """What the decode worker(s) pulled during phase 1 (engine metrics, deltas)."""

    num_bytes: float = 0.0
    num_pulls: int = 0
    total_s: float = 0.0  # summed pull durations: each includes the remote prefill it overlaps

    @property
    def mean_s(self) -> float | None:
        return self.total_s / self.num_pulls if self.num_pulls else None

    @property
    def gbps(self) -> float | None:
        return self.num_bytes / self.total_s / 1e9 if self.total_s else None


def pulls(before: Samples, after: Samples) -> Pulls:
    return Pulls(
        num_bytes=delta(before, after, "servelm:kv_transfer_bytes_total", direction="load", medium="remote"),
        num_pulls=int(round(delta(before, after, "servelm:kv_pull_seconds_count"))),
        total_s=delta(before, after, "servelm:kv_pull_seconds_sum"),
    )


@dataclass
class SystemResult:
    system: str
    mixed: dict[str, Any]  # phase 1's run.json summary
    c1: dict[str, Any]  # phase 2's run.json summary
    decisions: dict[str, int] = field(default_factory=dict)  # phase 1, router
    c1_decisions: dict[str, int] = field(default_factory=dict)  # phase 2, router
    pulls: Pulls = field(default_factory=Pulls)  # phase 1, decode workers


def figures(result: SystemResult) -> dict[str, float | None]:
    """The numbers the table shows for one system (seconds, per second, tokens per second)."""
    voice = result.mixed["classes"].get("voice", {})
    analytics = result.mixed["classes"].get("analytics", {})
    c1_voice = result.c1["classes"].get("voice", {})
    overall = result.mixed["overall"]

    def get(group: dict[str, Any], metric: str, key: str) -> float | None:
        return (group.get(metric) or {}).get(key)

    return {
        "voice_tbt_p50_s": get(voice, "tbt_s", "p50"),
        "voice_tbt_p99_s": get(voice, "tbt_s", "p99"),
        "voice_ttft_p50_s": get(voice, "ttft_s", "p50"),
        "voice_ttft_p99_s": get(voice, "ttft_s", "p99"),
        "voice_attainment": voice.get("attainment"),
        "voice_goodput": voice.get("goodput"),
        "output_tok_s": overall.get("output_token_throughput"),
        "requests_s": overall.get("request_throughput"),
        "analytics_ttft_p50_s": get(analytics, "ttft_s", "p50"),
        "failed": float(overall.get("num_requests", 0) - overall.get("num_ok", 0)),
        "c1_ttft_p50_s": get(c1_voice, "ttft_s", "p50"),
    }


@dataclass(frozen=True)
class Target:
    """One of the issue's targets: `ratio` is the improvement factor pd brings (> 1 better)."""

    name: str
    metric: str  # a key of figures()
    lower_is_better: bool
    at_least: float  # the ratio the issue asks for

    def ratio(self, pd: float | None, agg: float | None) -> float | None:
        if pd is None or agg is None or (agg if not self.lower_is_better else pd) == 0:
            return None
        return agg / pd if self.lower_is_better else pd / agg

    def met(self, pd: float | None, agg: float | None) -> bool | None:
        ratio = self.ratio(pd, agg)
        return None if ratio is None else ratio >= self.at_least - 1e-9


TARGETS = (
    Target("voice TBT p99 (agg / pd)", "voice_tbt_p99_s", lower_is_better=True, at_least=3.0),
    Target("voice goodput (pd / agg)", "voice_goodput", lower_is_better=False, at_least=1.5),
    Target("total output throughput (pd / agg)", "output_tok_s", lower_is_better=False, at_least=0.8),
    # "Within 10 %": pd's TTFT at most 1.1x agg's, i.e. agg / pd >= 1 / 1.1 (faster is fine).
    Target("concurrency 1 TTFT p50 (agg / pd)", "c1_ttft_p50_s", lower_is_better=True, at_least=1 / 1.1),
)

# (label, metric, unit): unit "ms" shows seconds as milliseconds.
ROWS = (
    ("voice TBT p50 (ms)", "voice_tbt_p50_s", "ms"),
    ("voice TBT p99 (ms)", "voice_tbt_p99_s", "ms"),
    ("voice TTFT p50 (ms)", "voice_ttft_p50_s", "ms"),
    ("voice TTFT p99 (ms)", "voice_ttft_p99_s", "ms"),
    ("voice SLO attainment", "voice_attainment", "%"),
    ("voice goodput (req/s)", "voice_goodput", "3f"),
    ("total output throughput (tok/s)", "output_tok_s", "1f"),
    ("total requests/s", "requests_s", "3f"),
    ("analytics TTFT p50 (ms)", "analytics_ttft_p50_s", "ms"),
    ("failed requests", "failed", "0f"),
    ("concurrency 1, voice TTFT p50 (ms)", "c1_ttft_p50_s", "ms"),
)


def cell(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "ms":
        return f"{value * 1000:.0f}"
    if unit == "%":
        return f"{value:.0%}"
    return f"{value:.{unit}}"


def format_table(results: dict[str, SystemResult], bandwidth: dict[str, Any] | None) -> str:
    """The markdown report: figures per system, the targets, pd's router decisions and pulls, bandwidth."""
    systems = [s for s in SYSTEMS if s in results]
    values = {s: figures(results[s]) for s in systems}
    lines = ["| metric | " + " | ".join(systems) + " |", "|---|" + "---:|" * len(systems)]
    for label, metric, unit in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(values[s][metric], unit) for s in systems) + " |")
    if {"pd", "agg"} <= set(systems):
        lines += ["", "| target | pd | agg | ratio | wanted | met |", "|---|---:|---:|---:|---:|---|"]
        for target in TARGETS:
            pd, agg = values["pd"][target.metric], values["agg"][target.metric]
            unit = next(unit for _, metric, unit in ROWS if metric == target.metric)
            ratio, met = target.ratio(pd, agg), target.met(pd, agg)
            lines.append(
                f"| {target.name} | {cell(pd, unit)} | {cell(agg, unit)} | {cell(ratio, '2f')}x "
                f"| >= {target.at_least:.2f}x | {'—' if met is None else 'yes' if met else 'NO'} |"
            )
    if "pd" in results:
        pd = results["pd"]
        # Each bench run sends one warm-up request before its workload: the router counts it too.
        lines += ["", "pd router decisions, phase 1 (+1 warm-up): " + format_decisions(pd.decisions),
                  "pd router decisions, concurrency 1 (+1 warm-up): " + format_decisions(pd.c1_decisions),
                  f"pd pulls, phase 1: {pd.pulls.num_pulls} pulls, {pd.pulls.num_bytes / 1e6:.1f} MB, mean pull "
                  f"{cell(pd.pulls.mean_s, 'ms')} ms; bytes / pull time {cell(pd.pulls.gbps, '3f')} GB/s "
                  "(end to end: a pull's time includes the remote prefill it overlaps)"]  # fmt: skip
    if bandwidth is not None:
        lines += ["", format_bandwidth(bandwidth)]
    return "\n".join(lines)


def format_decisions(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {n}" for key, n in sorted(counts.items())) or "none"


def format_bandwidth(report: dict[str, Any]) -> str:
    """kv_transfer_bandwidth.py's JSON as one line: pull GB/s against memcpy GB/s."""
    results = report["results"]
    memcpy = results["memcpy"]["median_gbps"]
    parts = [f"{name} {results[name]['median_gbps']:.2f} GB/s ({results[name]['median_gbps'] / memcpy:.0%} of memcpy)"
             for name in ("tcp", "ipc") if name in results]  # fmt: skip
    megabytes = report["num_blocks"] * report["block_bytes"] / 1e6
    return (f"transfer bandwidth (kv_transfer_bandwidth.py, {report['num_blocks']} blocks = {megabytes:.0f} MB, "
            f"median of {report['reps']}): pull " + ", ".join(parts) + f"; memcpy {memcpy:.2f} GB/s")  # fmt: skip


def run_system(system: str, args: argparse.Namespace) -> SystemResult:
    out = args.out / system
    with running_cluster(system, out) as urls:
        router = urls["router"]
        workers = [url for name, url in urls.items() if name != "router"]
        print(f"{system}: cluster up ({urls}); phase 1 ...", flush=True)
        router0, workers0 = scrape(router), [scrape(url) for url in workers]
        mixed = run_bench(router, out / "mixed", phase1_args(args))["summary"]
        router1, workers1 = scrape(router), [scrape(url) for url in workers]
        print(f"{system}: phase 2 (concurrency 1) ...", flush=True)
        c1 = run_bench(router, out / "c1", phase2_args(args))["summary"]
        router2 = scrape(router)
    total = Pulls()
    for before, after in zip(workers0, workers1):
        p = pulls(before, after)
        total = Pulls(total.num_bytes + p.num_bytes, total.num_pulls + p.num_pulls, total.total_s + p.total_s)
    return SystemResult(system, mixed, c1, decisions(router0, router1), decisions(router1, router2), total)


def run_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    path = args.out / "kv_transfer_bandwidth.json"
    command = [sys.executable, str(HERE / "kv_transfer_bandwidth.py"), "--num-blocks", str(args.bandwidth_blocks),
               "--out", str(path)]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads(path.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="pd,agg", help="run in this order")
    parser.add_argument("--weights", default="voice=0.6,analytics=0.4")
    parser.add_argument("--voice-output-tokens", default="200-300")
    parser.add_argument("--document-tokens", default="2000-4000")
    parser.add_argument("--rate", type=float, default=0.15, help="phase 1: requests/s, Poisson")
    parser.add_argument("--num-requests", type=int, default=50, help="phase 1")
    parser.add_argument("--duration-s", type=float, default=600.0, help="phase 1's wall-clock cap per system")
    parser.add_argument("--voice-tbt-slo", type=float, default=0.2, help="seconds: each voice stream's p90 gap")
    parser.add_argument("--c1-requests", type=int, default=20, help="phase 2: voice turns at concurrency 1")
    parser.add_argument("--bandwidth-blocks", type=int, default=64, help="phase 3: blocks per pull")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems):
        parser.error(f"--systems wants some of {SYSTEMS}, got {args.systems!r}")
    args.systems = systems
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = {system: run_system(system, args) for system in args.systems}
    print("phase 3: kv_transfer_bandwidth.py ...", flush=True)
    bandwidth = run_bandwidth(args)
    table = format_table(results, bandwidth)
    wall_s = time.monotonic() - started
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": platform.processor() or platform.machine(),
        "wall_s": wall_s,
        "systems": {
            s: {**asdict(r), "figures": figures(r), "pulls": {**asdict(r.pulls), "mean_s": r.pulls.mean_s}}
            for s, r in results.items()
        },  # fmt: skip
        "bandwidth": bandwidth,
        "table": table,
    }
    (args.out / "disagg.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "disagg.md").write_text(table + "\n")
    print(table)
    print(f"wall time {wall_s:.0f} s; reports in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
