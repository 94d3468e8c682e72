"""A short query after cached context (speculative verification's 1 + k tokens, a prefix hit's short
last chunk): attended as decode rows by the paged decode kernel (each row reads the context again; what
the attention backend does up to SHORT_QUERY_MAX = 12 tokens) against the chunk kernel (the context read
once for all rows). One layer, the default model's shape, one request, the two interleaved --rounds
times, the second best kept. A finding for the routing, which does not use it yet.

    PYTHONPATH=src .venv/bin/python benchmarks/short_query_paths.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from servelm.kernels import cpu as cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def second_best(fn: Callable[[], torch.Tensor], other: Callable[[], torch.Tensor], rounds: int) -> tuple[float, float]:
    """(fn, other) seconds, interleaved `rounds` times, the second best of each."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for f, into in ((fn, times[0]), (other, times[1])):
            started = time.perf_counter()
            f()
            into.append(time.perf_counter() - started)
    return sorted(times[0])[1], sorted(times[1])[1]


def measure(kernels: cpu_kernels.CpuKernels, context: int, num_queries: int, rounds: int) -> tuple[float, float]:
    """(decode rows, chunk kernel) seconds for `num_queries` new tokens after `context`."""
    seq_len = context + num_queries
    blocks = torch.arange(-(-seq_len // BLOCK_SIZE), dtype=torch.int32)
    pool = torch.randn(2, blocks.numel(), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    query = torch.randn(num_queries, HEADS, HEAD_DIM)
    # One decode row per token, the request's table repeated: row j sees context + j + 1 keys.
    tables = blocks.unsqueeze(0).expand(num_queries, -1).contiguous()
    lens = torch.arange(context + 1, seq_len + 1, dtype=torch.int32)
    batch = kernels.prepare_decode(tables, lens, seq_len)

    def decode_rows() -> torch.Tensor:
        return kernels.decode_prepared(query, pool[0], pool[1], batch, SCALE)

    def chunk() -> torch.Tensor:
        return kernels.chunk_attention(query, pool[0], pool[1], blocks, context, SCALE)

    torch.testing.assert_close(chunk(), decode_rows(), rtol=1e-4, atol=1e-5)
    return second_best(decode_rows, chunk, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="512,2048,6144")
    parser.add_argument("--queries", default="2,4,8,12,16")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_chunk_attention:
        raise SystemExit("the chunk kernel is not built here (no compiler, or no AVX2 + FMA)")
    print("| context | query tokens | decode rows (ms) | chunk kernel (ms) | chunk / decode |\n|---:|---:|---:|---:|---:|")
    for context in (int(x) for x in args.contexts.split(",")):
        for num_queries in (int(x) for x in args.queries.split(",")):
            rows, chunk = measure(kernels, context, num_queries, args.rounds)
            print(f"| {context} | {num_queries} | {rows * 1e3:.3f} | {chunk * 1e3:.3f} | {chunk / rows:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
