"""The tail of one stream's token gaps on an otherwise idle server: what the pauses between steps
(the keep-warm passes over the weights and the KV pool, worker/host_residency.py) add to TBT.

A fresh `servelm serve` of the default model at its defaults; --streams streams one after another,
each a fresh prompt asking --max-tokens tokens (greedy, ignore_eos, streamed); the gaps between
consecutive content chunks of every stream, pooled: p50, p99, p99.9 and the longest. With
--baseline-src, the same against another checkout's src/ (its own server), after this one.

    PYTHONPATH=src .venv/bin/python benchmarks/stream_gap_tail.py --baseline-src /work/base/src
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_checkout import parse_and_measure
from peer_servers import servelm_server


def stream_gaps(http: httpx.Client, prompt: str, max_tokens: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    arrivals = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


def measure(args: argparse.Namespace) -> list[float]:
    gaps: list[float] = []
    with servelm_server() as base_url, httpx.Client(base_url=base_url, timeout=300) as http:
        stream_gaps(http, "Warm up.", 8)
        for index in range(args.streams):
            gaps += stream_gaps(http, f"Story {index}: once upon a time, in a town by the sea,", args.max_tokens)
    return gaps


def _quantile_ms(gaps: list[float], q: float) -> float:
    ordered = sorted(gaps)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    _, rows = parse_and_measure(parser, __file__, measure)
    if rows is None:
        return
    for name, gaps in rows.items():
        print(f"{name}: {len(gaps)} gaps, p50 {round(1000 * statistics.median(gaps), 1)} ms, "
              f"p99 {_quantile_ms(gaps, 0.99)} ms, p99.9 {_quantile_ms(gaps, 0.999)} ms, "
              f"max {round(1000 * max(gaps), 1)} ms")  # fmt: skip


if __name__ == "__main__":
    main()
