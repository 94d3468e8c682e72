"""Context parallelism (issue 15): ring vs gathered queries, and what a CP=2 prefill spends communicating.

    python benchmarks/context_parallel.py crossover [--seq-len 4096] [--reps 5]
    python benchmarks/context_parallel.py prefill [--prompt-len 4096] [--reps 3]

Both run 2 real ranks (spawned processes, gloo over loopback, one torch thread each), CPU float32.

crossover: one attention layer of the default model's geometry (SmolLM2-135M: 9 heads, 3 KV
heads, head_dim 64), one request of `seq_len` positions whose last q are this step's chunk (the
rest cached in the pool), `ContextParallelBackend.forward` timed with each strategy forced, for q
from 1 to seq_len. The bytes model (context_layout.AttentionHeads) says the ring moves fewer bytes
once q / seq_len > 2 KVH D e / (2 H D e + 4 H) (0.32 here); the table shows where it gets faster.

prefill: the tiny test Llama (2 layers, hidden 64, 4 heads / 2 KV heads), one fresh prompt in one
step: CP=2 (forward on each rank's half + gather_hidden) against one rank with the torch backend.
Time blocked in collectives is measured by wrapping torch.distributed's all_gather,
all_to_all_single and batch_isend_irecv (posting + waiting) in the rank processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from servelm.attention.backend import CommonAttentionInputs
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.parallel.context_backend import ContextParallelBackend
from servelm.parallel.context_layout import AttentionHeads, Strategy
from servelm.parallel.groups import ParallelGroups, ParallelLayout
from servelm.testing.ranks import run_ranks
from servelm.testing.tiny_model import write_tiny_checkpoint
from servelm.worker.kv_cache import allocate_kv_caches
from servelm.worker.paged_inputs import paged_attention_inputs

SMOLLM2 = AttentionHeads(num_heads=9, num_kv_heads=3, head_dim=64)
TINY = AttentionHeads(num_heads=4, num_kv_heads=2, head_dim=16)
CP_SIZE, PHYSICAL_BLOCK = 2, 16


class CollectiveClock:
    """Seconds spent inside torch.distributed's collectives and P2P waits (patched in this process)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._all_gather, self._all_to_all, self._batch = (
            dist.all_gather,
            dist.all_to_all_single,
            dist.batch_isend_irecv,
        )
        dist.all_gather = self._timed(self._all_gather)  # type: ignore[assignment]
        dist.all_to_all_single = self._timed(self._all_to_all)  # type: ignore[assignment]
        dist.batch_isend_irecv = self._timed_batch  # type: ignore[assignment]

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed

    def _timed_batch(self, ops: Any) -> list[Any]:
        clock = self

        class TimedWork:
            def __init__(self, work: Any) -> None:
                self.work = work

            def wait(self) -> Any:
                started = time.perf_counter()
                try:
                    return self.work.wait()
                finally:
                    clock.seconds += time.perf_counter() - started

        return [TimedWork(w) for w in self._timed(self._batch)(ops)]


def _one_request(seq_len: int, query_len: int, block_size: int) -> tuple[torch.Tensor, CommonAttentionInputs]:
    """Positions and global inputs of one request's step: query_len new tokens after seq_len - query_len."""
    blocks = (seq_len + block_size - 1) // block_size
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
    return paged_attention_inputs(
        table,
        torch.tensor([0]),
        torch.tensor([seq_len - query_len]),
        torch.tensor([query_len]),
        block_size,
        torch.device("cpu"),
        torch.float32,
        torch.float32,
    )


def _crossover_rank(groups: ParallelGroups, seq_len: int, query_lens: list[int], reps: int) -> list[dict]:
    heads = SMOLLM2
    gen = torch.Generator().manual_seed(groups.cp.rank)
    blocks = (seq_len + PHYSICAL_BLOCK * CP_SIZE - 1) // (PHYSICAL_BLOCK * CP_SIZE)
    pool = torch.randn(2, blocks, PHYSICAL_BLOCK, heads.num_kv_heads, heads.head_dim, generator=gen)
    clock = CollectiveClock()
    rows = []
    for query_len in query_lens:
        _, common = _one_request(seq_len, query_len, PHYSICAL_BLOCK * CP_SIZE)
        row: dict[str, Any] = {"query_len": query_len}
        for strategy in (Strategy.GATHER, Strategy.RING):
            backend = ContextParallelBackend(groups.cp, heads, strategy)
            metadata = backend.build_metadata(common)
            n = metadata.local_token_index.numel()
            q = torch.randn(n, heads.num_heads, heads.head_dim, generator=gen)
            kv = torch.randn(n, heads.num_kv_heads, heads.head_dim, generator=gen)
            times, comm = [], []
            for rep in range(reps + 1):
                dist.barrier(group=groups.cp.group)
                clock.seconds = 0.0
                started = time.perf_counter()
                backend.forward(q, kv, kv, pool, metadata, heads.head_dim**-0.5)
                if rep:  # the first is a warm-up
                    times.append(time.perf_counter() - started)
                    comm.append(clock.seconds)
            row[strategy.value] = {"ms": 1e3 * statistics.median(times), "comm_ms": 1e3 * statistics.median(comm)}
            element = 4
            row[strategy.value]["bytes"] = (
                (
                    heads.ring_bytes(seq_len, element)
                    if strategy is Strategy.RING
                    else heads.gather_bytes(query_len, element)
                )
                * (CP_SIZE - 1)
                // CP_SIZE
            )
        rows.append(row)
    return rows


def _prefill_rank(groups: ParallelGroups, tiny_dir: Path, prompt_len: int, reps: int) -> dict:
    checkpoint = load_checkpoint(tiny_dir)
    backend = ContextParallelBackend(groups.cp, TINY)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu", attention_backend=backend)
    blocks = (prompt_len + PHYSICAL_BLOCK * CP_SIZE - 1) // (PHYSICAL_BLOCK * CP_SIZE)
    pools = allocate_kv_caches(checkpoint.arch, blocks, PHYSICAL_BLOCK, torch.float32, torch.device("cpu"))
    positions, common = _one_request(prompt_len, prompt_len, PHYSICAL_BLOCK * CP_SIZE)
    ids = torch.randint(0, checkpoint.arch.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    clock = CollectiveClock()
    times, comm = [], []
    for rep in range(reps + 1):
        dist.barrier(group=groups.cp.group)
        clock.seconds = 0.0
        started = time.perf_counter()
        metadata = backend.build_metadata(common)
        rows = metadata.local_token_index
        backend.gather_hidden(model(ids[rows], positions[rows], metadata, pools), metadata)
        if rep:
            times.append(time.perf_counter() - started)
            comm.append(clock.seconds)
    return {"step_ms": 1e3 * statistics.median(times), "comm_ms": 1e3 * statistics.median(comm)}


def _single_rank_prefill(tiny_dir: Path, prompt_len: int, reps: int) -> float:
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(tiny_dir)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    backend = model.decoder_layers[0].self_attn.backend
    block_size = PHYSICAL_BLOCK * CP_SIZE
    pools = allocate_kv_caches(checkpoint.arch, (prompt_len + block_size - 1) // block_size, block_size, torch.float32,
                               torch.device("cpu"))  # fmt: skip
    positions, common = _one_request(prompt_len, prompt_len, block_size)
    ids = torch.randint(0, checkpoint.arch.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    times = []
    for rep in range(reps + 1):
        started = time.perf_counter()
        model(ids, positions, backend.build_metadata(common), pools)
        if rep:
            times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["crossover", "prefill"])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    layout = ParallelLayout(context_parallel_size=CP_SIZE)
    result: dict[str, Any]
    if args.mode == "crossover":
        # Decodes, short chunks, then sixteenths of the sequence around the bytes model's crossover.
        fractions = (1, 2, 3, 4, 5, 6, 8, 12, 16)
        query_lens = sorted({q for q in (1, 16, 64) if q <= args.seq_len} | {args.seq_len * f // 16 for f in fractions})
        ranks = run_ranks(_crossover_rank, layout, args=(args.seq_len, query_lens, args.reps), timeout_s=1200)
        # A step lasts as long as its slowest rank: each strategy's figures are that rank's.
        rows = []
        for per_rank in zip(*ranks):
            row = dict(per_rank[0])
            for name in ("gather", "ring"):
                row[name] = max((r[name] for r in per_rank), key=lambda x: x["ms"])
            rows.append(row)
        result = {"seq_len": args.seq_len, "rows": rows, "per_rank": ranks}
        print(f"seq_len {args.seq_len}, 2 ranks: the slower rank's median ms (ms blocked in collectives), bytes")
        print(f"received per rank (the bytes model)\n{'q':>6} {'q/S':>6} {'gather ms':>14} {'ring ms':>14} "
              f"{'gather B':>10} {'ring B':>10}  faster")  # fmt: skip
        for row in rows:
            g, r = row["gather"], row["ring"]
            faster = "ring" if r["ms"] < g["ms"] else "gather"
            print(f"{row['query_len']:>6} {row['query_len'] / args.seq_len:>6.3f} "
                  f"{g['ms']:>8.2f} ({g['comm_ms']:>4.1f}) {r['ms']:>8.2f} ({r['comm_ms']:>4.1f}) "
                  f"{g['bytes']:>10} {r['bytes']:>10}  {faster}")  # fmt: skip
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tiny_dir = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
            ranks = run_ranks(_prefill_rank, layout, args=(tiny_dir, args.prompt_len, args.reps), timeout_s=1200)
            single = _single_rank_prefill(tiny_dir, args.prompt_len, args.reps)
        result = {"prompt_len": args.prompt_len, "ranks": ranks, "single_rank_ms": single}
        for rank, r in enumerate(ranks):
            print(f"rank {rank}: step {r['step_ms']:.1f} ms, in collectives {r['comm_ms']:.1f} ms "
                  f"({100 * r['comm_ms'] / r['step_ms']:.0f}%)")  # fmt: skip
        print(f"one rank, torch backend: {single:.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
