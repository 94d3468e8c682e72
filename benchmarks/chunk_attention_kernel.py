"""One layer's attention for a prompt chunk after cached context, on the default model's layer shape
(9 query heads over 3 KV heads, head_dim 64, blocks of 16, float32): the compiled chunk kernel
(csrc/chunk_attention.c, straight from the blocks) against the torch path it replaces (the context
gathered by block, then SDPA: one masked call below 256 queries, two flash calls merged from 256).

For each (context, chunk) case the two run interleaved, --rounds times each, and the second-best
time of each is kept (the host is shared: interleaving puts both under the same noise). The pool's
blocks are in order, as a lone prompt's are; --scattered shuffles them, as after churn.

    PYTHONPATH=src .venv/bin/python benchmarks/chunk_attention_kernel.py
    PYTHONPATH=src .venv/bin/python benchmarks/chunk_attention_kernel.py --contexts 6144 --chunks 256,512,1024
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from servelm.attention import torch_backend
from servelm.attention.kv_storage import gather_kv_blocks
from servelm.kernels import cpu as cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def time_once(fn: Callable[[], torch.Tensor], times: list[float]) -> None:
    started = time.perf_counter()
    fn()
    times.append(time.perf_counter() - started)


def measure_case(kernels: cpu_kernels.CpuKernels, pool: torch.Tensor, order: torch.Tensor, context: int,
                 num_queries: int, rounds: int, gen: torch.Generator) -> tuple[float, float]:  # fmt: skip
    """(torch path, kernel) seconds for one chunk of `num_queries` after `context`: the second best
    of `rounds`, the two interleaved."""
    seq_len = context + num_queries
    blocks = order[: -(-seq_len // BLOCK_SIZE)]
    blocks_i32 = blocks.to(torch.int32)
    query = torch.randn(num_queries, HEADS, HEAD_DIM, generator=gen)
    split = torch_backend._splits_at_context(num_queries, query.device)
    mask = None if split else torch_backend._causal_mask(num_queries, seq_len, query.device)

    def torch_path() -> torch.Tensor:
        k = gather_kv_blocks(pool, 0, blocks, seq_len, torch.float32)
        v = gather_kv_blocks(pool, 1, blocks, seq_len, torch.float32)
        return torch_backend._attend(query, k, v, SCALE, mask)

    def kernel() -> torch.Tensor:
        return kernels.chunk_attention(query, pool[0], pool[1], blocks_i32, context, SCALE)

    torch.testing.assert_close(kernel(), torch_path(), rtol=1e-4, atol=1e-5)
    torch_times: list[float] = []
    kernel_times: list[float] = []
    for _ in range(rounds):
        time_once(torch_path, torch_times)
        time_once(kernel, kernel_times)
    return sorted(torch_times)[1], sorted(kernel_times)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,3072,6144")
    parser.add_argument("--chunks", default="16,32,64,128,200,255,256,512,1024")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scattered", action="store_true")
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_chunk_attention:
        raise SystemExit("the chunk kernel is not built here (no compiler, or no AVX2 + FMA)")
    contexts = [int(x) for x in args.contexts.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    num_blocks = (max(contexts) + max(chunks)) // BLOCK_SIZE + 2
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen) if args.scattered else torch.arange(num_blocks)
    print(f"threads {torch.get_num_threads()}, blocks {'scattered' if args.scattered else 'in order'}")
    print("| context | chunk | torch path (ms) | kernel (ms) | kernel / torch |\n|---:|---:|---:|---:|---:|")
    for context in contexts:
        for num_queries in chunks:
            t_torch, t_kernel = measure_case(kernels, pool, order, context, num_queries, args.rounds, gen)
            split = torch_backend._splits_at_context(num_queries, torch.device("cpu"))
            print(f"| {context} | {num_queries}{' (split)' if split else ''} | {t_torch * 1e3:.2f} | "
                  f"{t_kernel * 1e3:.2f} | {t_kernel / t_torch:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
