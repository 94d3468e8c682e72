"""The longest pause keeping memory warm puts between two engine steps: a whole pass against a slice.

A CPU engine reads one byte per page of its weights (every keep_warm_s) and of its KV pool (5x less
often) so a VM host does not let them go cold (worker/host_residency.py). The read runs between
steps, and a request arriving meanwhile waits for it. A whole pass over the default model's 2 GiB
pool was one ~18 ms pause; it is now read a slice (SLICE_BYTES) per call between steps, and the
idle loop polls its inputs between slices.

On the default model at its default KV budget, per repeat: the time of a whole pass (`touch()`,
the way it ran before) of the weights and of the pool, then the time of every `keep_warm()` call
of one sliced pass of both (its longest call is the longest pause a request can meet now).

    PYTHONPATH=src .venv/bin/python benchmarks/keep_warm_pause.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.worker.host_residency import SLICE_BYTES


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    core = build_engine(EngineConfig.from_flat()).core
    weights, pool = core.residencies
    print(f"weights {weights.num_bytes / 2**20:.0f} MiB, pool {pool.num_bytes / 2**20:.0f} MiB, "
          f"slice {SLICE_BYTES / 2**20:.0f} MiB")  # fmt: skip
    whole: dict[str, list[float]] = {"weights": [], "pool": []}
    calls: list[float] = []
    sliced_totals: list[float] = []
    for _ in range(args.repeats):
        for name, residency in (("weights", weights), ("pool", pool)):
            started = time.perf_counter()
            residency.touch()
            whole[name].append(time.perf_counter() - started)
        for residency in core.residencies:
            residency._last_start -= 1e6  # both due now
        total = 0.0
        while True:
            started = time.perf_counter()
            due = core.keep_warm()
            elapsed = time.perf_counter() - started
            calls.append(elapsed)
            total += elapsed
            if not due:
                break
        sliced_totals.append(total)
    for name, times in whole.items():
        print(f"whole pass, {name}: median {_ms(statistics.median(times))} ms, max {_ms(max(times))} ms")
    print(f"sliced pass of both: {len(calls) // args.repeats} calls, median call {_ms(statistics.median(calls))} ms, "
          f"longest call {_ms(max(calls))} ms, whole sliced pass median {_ms(statistics.median(sliced_totals))} ms")  # fmt: skip


if __name__ == "__main__":
    main()
