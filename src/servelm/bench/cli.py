"""`servelm bench run | sweep | compare | report`.

    servelm bench run --base-url http://127.0.0.1:8000 --profile mixed \
        --weights voice=0.4,code=0.3,analytics=0.2,chat=0.1 --rate 2 --num-requests 200 --duration-s 300 --out out/
    servelm bench run ... --arrival gamma --burstiness 0.5 --rate 2      # burstier than Poisson
    servelm bench run ... --concurrency 8                                # closed loop
    servelm bench run ... --trace mooncake.jsonl --time-scale 0.5        # replay, twice as fast
    servelm bench sweep ... --rates 0.5,1,2 --target-attainment 0.9
    servelm bench compare A/run.json B/run.json
    servelm bench report A/run.json --slo voice:ttft=0.3               # re-analyse a saved run (or sweep.json)
    servelm bench run ... --slow-readers 0.3 --read-delay-ms 250       # that fraction of clients reads slowly
    servelm bench scenario long-docs --out out/ [--base-url URL] [--quick]  # baseline + today windows, diagnosed
    servelm bench scenario all --out out/                              # the whole "TTFT tripled" suite
    servelm bench proxy --target 127.0.0.1:8000 --listen-port 8001 --delay-ms 50 --jitter-ms 10 --loss 0.01

Only argparse is imported here: `servelm serve` builds the same parser and must not pay for
the benchmark's imports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _floats(spec: str) -> list[float]:
    try:
        values = [float(v) for v in spec.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {spec!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {spec!r}")
    return values


def _add_common(parser: argparse.ArgumentParser) -> None:
    _add_server(parser)
    add_workload_arguments(parser)


def _add_server(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="any OpenAI-compatible server")
    target.add_argument("--api-key", default=None)
    target.add_argument("--api-keys", default=None, metavar="PROFILE=KEY,...",
                        help="a key per traffic class (e.g. voice=K1,code=K2: each class is its own tenant); "
                             "other classes use --api-key, else the first of these")  # fmt: skip
    target.add_argument("--model", default=None, help="the request's model field (default: the server's first)")
    target.add_argument("--tokenizer", default=None,
                        help="HF directory or .gguf (default: the server's model id as a path)")  # fmt: skip
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument("--priority", choices=["auto", "on", "off"], default="auto",
                        help="send each class's priority (auto: to servelm only)")  # fmt: skip
    target.add_argument("--timeline", choices=["auto", "on", "off"], default="auto",
                        help="ask for servelm's TTFT breakdown (auto: servelm only)")  # fmt: skip
    target.add_argument("--no-ignore-eos", action="store_false", dest="ignore_eos",
                        help="let outputs end at EOS (default: run to max_tokens)")  # fmt: skip
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--request-timeout-s", type=float, default=600.0)


# What `_add_server` would set, for a command that sends nothing over HTTP (`servelm simulate run`).
NO_SERVER_DEFAULTS = {"base_url": "simulated", "api_key": None, "api_keys": None, "model": None, "tokenizer": None,
                      "endpoint": "completions", "priority": "on", "timeline": "off", "ignore_eos": True,
                      "temperature": 0.0, "request_timeout_s": 600.0}  # fmt: skip


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload (profile, lengths, arrivals, SLOs) and output flags of `bench run` and `bench sweep`."""
    work = parser.add_argument_group("workload")
    work.add_argument("--profile", choices=["voice", "code", "analytics", "chat", "longchat", "mixed"],
                      default="mixed")  # fmt: skip
    work.add_argument("--weights", default="voice=0.4,code=0.3,analytics=0.2,chat=0.1", help="mixed profile weights")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--num-requests", type=int, default=100, help="requests per run (per sweep step)")
    work.add_argument("--duration-s", type=float, default=600.0, help="wall-clock limit per run (per sweep step)")
    work.add_argument("--length-scale", type=float, default=1.0, dest="prompt_scale", help="multiplies prompt lengths")
    work.add_argument("--max-output-tokens", type=int, default=None, help="caps every output length")
    work.add_argument("--max-context", type=int, default=None, help="default: the server's max_model_len")
    work.add_argument("--slo", action="append", default=[], metavar="CLASS:ttft=S,tbt=S,e2e=S,p=PCT",
                      help="override a class's SLO (repeatable)")  # fmt: skip
    work.add_argument("--chat-dataset", type=Path, default=None, help="ShareGPT JSON: chat lengths drawn from it")
    work.add_argument("--arrival", choices=["poisson", "gamma", "daily"], default="poisson",
                      help="daily: Poisson at a rate following a day's curve, --rate on average (1M a day: 11.57)")  # fmt: skip
    work.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, < 1 burstier")
    work.add_argument("--document-tokens", default=None, metavar="LOW-HIGH",
                      help="analytics documents' prompt lengths (default 500-2000)")  # fmt: skip
    work.add_argument("--voice-output-tokens", default=None, metavar="LOW-HIGH",
                      help="voice turns' output lengths (default 20-80)")  # fmt: skip
    work.add_argument("--sessions", type=int, default=None, metavar="N",
                      help="conversations open at once in the voice and longchat profiles (default 4)")  # fmt: skip
    work.add_argument("--slow-readers", type=float, default=0.0, metavar="FRACTION",
                      help="that fraction of clients reads its stream slowly (small window, see --read-delay-ms)")  # fmt: skip
    work.add_argument("--read-delay-ms", type=float, default=200.0, help="slow readers: busy this long after each read")
    work.add_argument("--read-bytes", type=int, default=1024, help="slow readers: at most this much per read")
    work.add_argument("--slow-reader-logprobs", type=int, default=0, help="slow readers ask for this many logprobs")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the reports")
    out.add_argument("--no-progress", action="store_false", dest="progress")
    out.add_argument("--no-plots", action="store_false", dest="plots")


def add_bench_parser(subparsers: argparse._SubParsersAction, launch_server=None) -> None:
    """`launch_server`: the scenario's server starter (a ServerLauncher, see bench.scenario_run),
    given by `servelm.cli`, which may import the server; bench/ itself talks HTTP only."""
    bench = subparsers.add_parser("bench", help="load generator: mixed workloads, SLOs, goodput, sweeps, reports")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    run = sub.add_parser("run", help="one run at one load")
    _add_common(run)
    load = run.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="open loop: requests/s (default 1)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    load.add_argument("--trace", type=Path, default=None, help="replay a Mooncake-format JSONL trace")
    run.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply the gaps (0.5 = twice as fast)")
    run.add_argument("--trace-time-unit-s", type=float, default=0.001, help="trace timestamp unit (ms)")
    run.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash id")
    run.set_defaults(handler=_run)

    sweep = sub.add_parser("sweep", help="the same workload at several loads; the highest within the SLOs")
    _add_common(sweep)
    loads = sweep.add_mutually_exclusive_group(required=True)
    loads.add_argument("--rates", type=_floats, default=None, help="e.g. 0.5,1,2")
    loads.add_argument("--concurrencies", type=_floats, default=None, help="e.g. 1,4,16")
    sweep.add_argument("--target-attainment", type=float, default=0.9, help="every class must reach it")
    sweep.set_defaults(handler=_sweep)

    compare = sub.add_parser("compare", help="per-metric ratios of two run.json reports")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    compare.set_defaults(handler=_compare)

    report = sub.add_parser("report", help="re-judge a saved run.json or sweep.json (e.g. by other SLOs): md and plots")
    report.add_argument("run_json", type=Path, help="a run.json, or a sweep.json (its steps' run.json beside it)")
    report.add_argument("--slo", action="append", default=[])
    report.add_argument("--out", type=Path, default=None, help="default: next to run.json")
    report.set_defaults(handler=_report)

    scenario = sub.add_parser("scenario", help='"TTFT tripled": a baseline and a today window, then diagnose')
    scenario.add_argument("name", help="long-docs | kv-pressure | slow-readers | network-delay | long-histories | all")
    scenario.add_argument("--out", type=Path, required=True, help="DIR: DIR/baseline, DIR/today (all: DIR/NAME/...)")
    scenario.add_argument("--base-url", default=None, help="a running server (default: start one with the scenario's flags)")
    scenario.add_argument("--model", default=None, help="the started server's model (default: the embedded default)")
    scenario.add_argument("--api-key", default=None)
    scenario.add_argument("--tokenizer", default=None)
    scenario.add_argument("--quick", action="store_true", help="CI size: short windows, prompts for the tiny model")
    scenario.add_argument("--rate", type=float, default=None, help="requests/s in both windows (default: the scenario's "
                          "share of the capacity it measures first, or its fixed rate)")
    scenario.add_argument("--seconds", type=float, default=None, help="each window's length (default: the scenario's)")
    scenario.add_argument("--sessions", type=int, default=None,
                          help="conversations open at once (voice, longchat; default 4): more offer a high rate")  # fmt: skip
    scenario.add_argument("--seed", type=int, default=0)
    scenario.add_argument("--no-progress", action="store_false", dest="progress")
    scenario.set_defaults(handler=_scenario, launch_server=launch_server)

    proxy = sub.add_parser("proxy", help="a TCP proxy on 127.0.0.1 adding delay, jitter and loss")
    proxy.add_argument("--target", required=True, help="HOST:PORT to forward to")
    proxy.add_argument("--listen-port", type=int, required=True)
    proxy.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each direction")
    proxy.add_argument("--jitter-ms", type=float, default=0.0)
    proxy.add_argument("--loss", type=float, default=0.0, help="probability a chunk costs a retransmission")
    proxy.add_argument("--rto-ms", type=float, default=200.0, help="what a retransmission costs")
    proxy.add_argument("--seed", type=int, default=0)
    proxy.set_defaults(handler=_proxy)


def _range(spec: str | None, flag: str) -> tuple[int, int] | None:
    from servelm.bench.profiles import parse_range

    return parse_range(spec, flag) if spec else None


def bench_config(args: argparse.Namespace):
    """The BenchConfig of parsed `bench run | sweep` flags (or a command's own with the same names)."""
    from servelm.bench.execute import BenchConfig
    from servelm.bench.profiles import parse_api_keys, parse_weights
    from servelm.bench.workload import DEFAULT_SLOS, parse_slo

    slos = dict(DEFAULT_SLOS)
    for spec in args.slo:
        slos = parse_slo(spec, slos)
    trace = getattr(args, "trace", None)
    return BenchConfig(
        base_url=args.base_url.rstrip("/"), out_dir=args.out, profile="trace" if trace else args.profile,
        weights=parse_weights(args.weights), seed=args.seed, num_requests=args.num_requests,
        duration_s=args.duration_s, arrival=args.arrival, burstiness=args.burstiness, trace=trace,
        time_scale=getattr(args, "time_scale", 1.0), trace_time_unit_s=getattr(args, "trace_time_unit_s", 0.001),
        trace_block_size=getattr(args, "trace_block_size", 512), slos=slos, prompt_scale=args.prompt_scale,
        max_output_tokens=args.max_output_tokens, max_context=args.max_context, api_key=args.api_key,
        api_keys=parse_api_keys(args.api_keys) if args.api_keys else {},
        model=args.model, tokenizer=args.tokenizer, endpoint=args.endpoint, temperature=args.temperature,
        ignore_eos=args.ignore_eos, priority=args.priority, timeline=args.timeline,
        request_timeout_s=args.request_timeout_s, chat_dataset=args.chat_dataset, progress=args.progress,
        plots=args.plots, document_tokens=_range(args.document_tokens, "--document-tokens"),
        voice_output_tokens=_range(args.voice_output_tokens, "--voice-output-tokens"), sessions=args.sessions,
        slow_readers=args.slow_readers,
        read_delay_ms=args.read_delay_ms, read_bytes=args.read_bytes, slow_reader_logprobs=args.slow_reader_logprobs,
    )  # fmt: skip


def _quietly(handler):
    """Per-request HTTP logs off; a bad argument or an unreachable server is one line, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        import logging

        import httpx

        from servelm.bench.tokens import TokenizationError

        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            return handler(args)
        except (ValueError, OSError, RuntimeError, TokenizationError, httpx.HTTPError) as exc:
            print(f"servelm bench: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # before the run started (loading the tokenizer): nothing measured yet
            print("servelm bench: interrupted before any request was sent", file=sys.stderr)
            return 130

    return run


@_quietly
def _run(args: argparse.Namespace) -> int:
    from servelm.bench.execute import load_of, prepare, run_once

    config = bench_config(args)
    report = run_once(prepare(config), config, load_of(args), config.out_dir)
    print((config.out_dir / "summary.md").read_text())
    print(f"reports in {config.out_dir}/ (run.json, summary.md, plots)", file=sys.stderr)
    return 130 if report["result"]["interrupted"] else 0


@_quietly
def _sweep(args: argparse.Namespace) -> int:
    from servelm.bench.execute import prepare
    from servelm.bench.sweep import run_sweep

    if args.concurrencies and any(c != int(c) for c in args.concurrencies):
        raise SystemExit("--concurrencies must be whole numbers")
    config = bench_config(args)
    mode, loads = ("rate", args.rates) if args.rates else ("concurrency", args.concurrencies)
    sweep = run_sweep(prepare(config), config, mode, loads, args.target_attainment, config.out_dir)
    print((config.out_dir / "sweep.md").read_text())
    return 130 if sweep["interrupted"] else 0


@_quietly
def _compare(args: argparse.Namespace) -> int:
    from servelm.bench.compare import compare_summaries, format_comparison
    from servelm.bench.report import load_report

    a, b = load_report(args.a), load_report(args.b)
    if a["kind"] != "run" or b["kind"] != "run":
        raise SystemExit("compare takes two run.json reports (a sweep's steps each have one)")
    print(format_comparison(compare_summaries(a["summary"], b["summary"]), str(args.a), str(args.b)), end="")
    return 0


@_quietly
def _report(args: argparse.Namespace) -> int:
    from servelm.bench.plots import plot_run
    from servelm.bench.report import (
        load_report,
        records_of,
        run_markdown,
        slos_of,
        write_json,
    )
    from servelm.bench.stats import summarize
    from servelm.bench.sweep import reanalyse_sweep
    from servelm.bench.workload import SLO, parse_slo

    report = load_report(args.run_json)
    slos = (
        slos_of(report) if report["kind"] == "run" else {n: SLO(**raw) for n, raw in report["config"]["slos"].items()}
    )
    for spec in args.slo:
        slos = parse_slo(spec, slos)
    out = args.out or args.run_json.parent
    if report["kind"] == "sweep":
        reanalyse_sweep(report, args.run_json.parent, slos, out)
        print((out / "sweep.md").read_text())
        return 0
    records = records_of(report)
    report["slos"] = {name: slo.to_dict() for name, slo in slos.items()}
    report["summary"] = summarize(records, slos, report["result"]["duration_s"]).to_dict()
    write_json(report, out / "run.json")
    plots = plot_run(records, report["summary"], out)
    (out / "summary.md").write_text(run_markdown(report, plots))
    print((out / "summary.md").read_text())
    return 0


@_quietly
def _scenario(args: argparse.Namespace) -> int:
    from servelm.bench.scenario_run import ScenarioOptions, run_scenario
    from servelm.bench.scenarios import SCENARIOS, get_scenario

    names = list(SCENARIOS) if args.name == "all" else [get_scenario(args.name).name]
    results = []
    for name in names:
        out = args.out / name if args.name == "all" else args.out
        options = ScenarioOptions(out_dir=out, quick=args.quick, base_url=args.base_url, model=args.model,
                                  tokenizer=args.tokenizer, api_key=args.api_key, seed=args.seed, rate=args.rate,
                                  seconds=args.seconds, sessions=args.sessions, progress=args.progress)  # fmt: skip
        result = run_scenario(SCENARIOS[name], options, args.launch_server)
        results.append(result)
        verdict = "ok" if result.ok else "WRONG" if result.top_cause else f"no diagnosis ({result.error})"
        sized = f"{result.rate:.3g} req/s" + (f" of {result.capacity:.3g} measured" if result.capacity else "")
        print(f"{name}: expected {result.expected_cause}, diagnose named {result.top_cause}: {verdict}  "
              f"({sized}; {out})")
    if args.name == "all":
        import json

        (args.out / "suite.json").write_text(json.dumps([r.to_dict() for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


@_quietly
def _proxy(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from servelm.bench.delay_proxy import LinkFaults, serve_forever

    faults = LinkFaults(args.delay_ms / 1000.0, args.jitter_ms / 1000.0, args.loss, args.rto_ms / 1000.0)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_forever(args.target, args.listen_port, faults, args.seed))
    return 0
