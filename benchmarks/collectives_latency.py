"""Latency of one small collective on 2 CPU ranks (one thread each): through the shared-memory
segment (servelm.parallel.shm_collectives) against gloo's loopback TCP, on the same group.

    .venv/bin/python benchmarks/collectives_latency.py [--calls 2000]

The tensors are a decode / prefill step's: the all-reduce of a [T, 576] float32 hidden state (the
default model's width) for T = 1, 16, 512, and the all-gather of a [1, 49152] vocabulary's logits
split over the ranks. A call's time is the median over `--calls` back-to-back calls on rank 0 (the
ranks keep in step by themselves: each call waits for the other rank); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from servelm.parallel.groups import GroupMember, ParallelGroups, ParallelLayout, all_gather_last_dim, all_reduce_sum
from servelm.testing.ranks import run_ranks

VOCAB = 49152
CASES: dict[str, tuple[str, tuple[int, ...]]] = {
    "all-reduce [1, 576]": ("reduce", (1, 576)),
    "all-reduce [16, 576]": ("reduce", (16, 576)),
    "all-reduce [512, 576]": ("reduce", (512, 576)),
    f"all-gather [1, {VOCAB}]": ("gather", (1, VOCAB)),
}


def median_call_s(call: Callable[[], object], calls: int) -> float:
    for _ in range(50):  # warm-up
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def latencies(groups: ParallelGroups, calls: int) -> dict[str, dict[str, float]]:
    shm = groups.tp
    assert shm.shared_memory is not None, "the ranks share this host: the group has its segment"
    gloo = GroupMember(shm.rank, shm.size, shm.group)  # the same group without its segment
    result = {}
    for label, (kind, shape) in CASES.items():
        result[label] = {}
        for path, member in (("shm", shm), ("gloo", gloo)):
            if kind == "reduce":
                x = torch.zeros(shape)  # summed in place call after call: zeros stay finite
                result[label][path] = median_call_s(lambda: all_reduce_sum(x, member), calls)  # noqa: B023
            else:
                sizes = [shape[-1] // member.size] * member.size
                x = torch.randn(*shape[:-1], sizes[member.rank])
                result[label][path] = median_call_s(lambda: all_gather_last_dim(x, member, sizes), calls)  # noqa: B023
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    result = run_ranks(latencies, ParallelLayout(2), (args.calls,), timeout_s=600)[0]
    print(f"2 ranks, 1 thread each, median of {args.calls} calls (rank 0)")
    print(f"{'collective':<26} {'shm us':>8} {'gloo us':>8} {'gloo/shm':>9}")
    for label, times in result.items():
        print(f"{label:<26} {1e6 * times['shm']:8.1f} {1e6 * times['gloo']:8.1f} {times['gloo'] / times['shm']:8.1f}x")


if __name__ == "__main__":
    main()
