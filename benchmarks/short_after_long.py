"""A short request sent while a long prompt prefills, at `make serve` defaults: what it waits (issue 38).

Through the API, one fresh server per system: for each long prompt length (--longs, tokens), a
completion of that many fresh random token ids (max_tokens 1) starts, and --offset-s later a
16-token one (max_tokens 16) is sent; both stream. Per trial: the long request's TTFT, the short
one's TTFT and its completion time, counted from its own send. Then the long prompt alone
(--lone tokens, --lone-trials times, the median kept): its TTFT, the engine's step times and the
step-cost model's measured / predicted ratio by kind (from /metrics), the reference being `servelm-unchunked` (the whole prompt in one
step: no step-time bound, a budget of --lone tokens).

    PYTHONPATH=src .venv/bin/python benchmarks/short_after_long.py --out /tmp/short-after-long
    PYTHONPATH=src .venv/bin/python benchmarks/short_after_long.py --systems servelm,vllm

Targets (issue 38): short TTFT <= 0.15x the long request's TTFT and <= 0.5 s on a CPU; the lone
long prompt's TTFT <= 1.10x the unchunked one; step time p99 <= 1.5x the target.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import prepare_model_dir
from peer_servers import parse_systems, servelm_server, stop_servers_on_sigterm, vllm_server

from servelm.diagnose.prom import gauge_totals, parse_text
from servelm.diagnose.window import Window, counter_deltas, histogram_deltas, summarize_gauges

SHORT_TOKENS = 16
SHORT_MAX_TOKENS = 16


def system_flags(system: str, lone: int) -> tuple[str, ...] | None:
    """`servelm serve` flags of a system; None: vLLM-CPU."""
    return {
        "servelm": (),
        "servelm-unchunked": ("--max-step-ms", "0", "--max-num-batched-tokens", str(lone)),
        "vllm": None,
    }[system]


SYSTEMS = ("servelm", "servelm-unchunked", "vllm")


@contextmanager
def serving(system: str, lone: int, log_dir: Path) -> Iterator[str]:
    flags = system_flags(system, lone)
    if flags is None:
        with vllm_server(prepare_model_dir(Path("/tmp/servelm-offline-bench"))[0], log_dir) as base_url:
            yield base_url
    else:
        with servelm_server(flags) as base_url:
            yield base_url


def stream(http: httpx.Client, base_url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds to the last) of a streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    sent = time.perf_counter()
    first = None
    with http.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if first is None and json.loads(line[6:])["choices"][0].get("text") is not None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - sent, end - sent


def fresh_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 10000) for _ in range(num_tokens)]


def run_system(system: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"system": system, "trials": []}
    with serving(system, args.lone, args.out / system) as base_url, httpx.Client() as http:
        model = http.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        stream(http, base_url, model, fresh_prompt(rng, 64), 4)  # warm-up
        for num_long in args.longs if system != "servelm-unchunked" else []:
            for _ in range(args.trials):
                long_times: list[tuple[float, float]] = []
                long_prompt = fresh_prompt(rng, num_long)
                thread = threading.Thread(target=lambda t=long_times, p=long_prompt: t.append(  # type: ignore[misc]
                    stream(http, base_url, model, p, 1)))  # fmt: skip
                thread.start()
                time.sleep(args.offset_s)
                short_ttft, short_done = stream(http, base_url, model, fresh_prompt(rng, SHORT_TOKENS), SHORT_MAX_TOKENS)
                thread.join()
                trial = {"long": num_long, "long_ttft_s": long_times[0][0], "short_ttft_s": short_ttft,
                         "short_done_s": short_done}  # fmt: skip
                result["trials"].append(trial)
                print(system, trial, flush=True)
        before = parse_text(http.get(f"{base_url}/metrics").text) if system != "vllm" else None
        # Several times, the median kept: one 8k prompt's TTFT on a shared 2-core VM moved 10-20%
        # between runs minutes apart, as much as the 10% that chunking may cost.
        result["lone_ttfts_s"] = [stream(http, base_url, model, fresh_prompt(rng, args.lone), 1)[0]
                                  for _ in range(args.lone_trials)]  # fmt: skip
        result["lone_ttft_s"] = statistics.median(result["lone_ttfts_s"])
        if before is not None:
            after = parse_text(http.get(f"{base_url}/metrics").text)
            result["lone_metrics"] = lone_metrics(before, after)
        print(system, "lone", result["lone_ttfts_s"], result.get("lone_metrics"), flush=True)
    return result


def lone_metrics(before: Any, after: Any) -> dict[str, Any]:
    """Step-time quantiles and the prediction ratio's, over the lone prompt's steps (the delta)."""
    window = Window("lone", "metrics", 0.0, 1.0, counter_deltas(before, after), histogram_deltas(before, after),
                    summarize_gauges([gauge_totals(after)]), None)  # fmt: skip
    out: dict[str, Any] = {}
    steps = window.histogram("servelm:engine_step_seconds")
    if steps is not None:
        out.update(steps=steps.count, step_p50_s=steps.quantile(0.5), step_p99_s=steps.quantile(0.99))
    out["target_s"] = gauge_totals(after).get("servelm:step_time_target_seconds")
    for kind in ("shallow", "deep", "decode"):
        ratio = window.histogram("servelm:step_time_prediction_ratio", kind=kind)
        if ratio is not None and ratio.count:
            out[f"{kind}_ratio"] = {"count": ratio.count, "p10": ratio.quantile(0.1), "p50": ratio.quantile(0.5),
                                    "p90": ratio.quantile(0.9)}  # fmt: skip
    return out


def summary(results: list[dict[str, Any]]) -> str:
    lines = ["| system | long (tokens) | long TTFT (s) | short TTFT (s) | short/long | short done (s) |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for result in results:
        for num_long in sorted({t["long"] for t in result["trials"]}):
            trials = [t for t in result["trials"] if t["long"] == num_long]
            long_s = statistics.median(t["long_ttft_s"] for t in trials)
            short_s = max(t["short_ttft_s"] for t in trials)
            done_s = max(t["short_done_s"] for t in trials)
            lines.append(f"| {result['system']} | {num_long} | {long_s:.2f} | {short_s:.3f} (max) | "
                         f"{short_s / long_s:.3f} | {done_s:.2f} |")  # fmt: skip
    lines.append("")
    lines += [f"{r['system']}: lone prompt TTFT {r['lone_ttft_s']:.2f} s (median of {len(r['lone_ttfts_s'])}: "
              f"{', '.join(f'{t:.2f}' for t in r['lone_ttfts_s'])}) {r.get('lone_metrics', '')}" for r in results]  # fmt: skip
    by_system = {r["system"]: r["lone_ttft_s"] for r in results}
    if "servelm" in by_system and "servelm-unchunked" in by_system:
        lines.append(f"lone prompt, chunked / unchunked: {by_system['servelm'] / by_system['servelm-unchunked']:.3f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="servelm,servelm-unchunked")
    parser.add_argument("--longs", type=lambda t: [int(x) for x in t.split(",")], default=[2000, 4000, 6000, 8000])
    parser.add_argument("--lone", type=int, default=8000, help="tokens of the long prompt measured alone")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--lone-trials", type=int, default=3, help="times the lone prompt runs (the median is kept)")
    parser.add_argument("--offset-s", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--out", type=Path, default=Path("/tmp/short-after-long"))
    args = parser.parse_args()
    stop_servers_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_system(system, args) for system in parse_systems(args.systems, SYSTEMS)]
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(summary(results))


if __name__ == "__main__":
    main()
