"""Run a function on every rank of a parallel layout, each rank a real spawned process (gloo on CPU,
one torch thread unless told), and collect what each returns: for tests of multi-rank models.

    results = run_ranks(fn, ParallelLayout(2), args=(path,))   # [fn(groups of rank 0, path), ...]

`fn` must be importable by name (a module-level function), its arguments and result picklable;
tensors in the result come back through torch.save. A rank that raises fails the whole call with
its traceback; a rank that does not finish within `timeout_s` is killed (only the processes this
call started) and the call raises TimeoutError.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from servelm.parallel.groups import ParallelGroups, ParallelLayout


def _rank_main(fn: Callable[..., Any], layout: ParallelLayout, rank: int, init_file: str, args: tuple[Any, ...],
               threads: int, timeout_s: float, shared_memory: bool, results: Any) -> None:  # fmt: skip
    try:
        torch.set_num_threads(threads)
        groups = ParallelGroups.initialize(
            layout, rank, f"file://{init_file}", "gloo", timeout_s, shared_memory=shared_memory
        )
        buffer = io.BytesIO()
        torch.save(fn(groups, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, named
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    layout: ParallelLayout,
    args: tuple[Any, ...] = (),
    *,
    threads: int = 1,
    timeout_s: float = 120.0,
    shared_memory: bool = True,
) -> list[Any]:
    """fn(groups, *args) on every rank of `layout`; each rank's result, rank order. `shared_memory`:
    whether the groups get their shared-memory segments (False: every collective over gloo)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "init")
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, layout, rank, init_file, args, threads, timeout_s, shared_memory, results),
            )
            for rank in range(layout.world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        collected: dict[int, Any] = {}
        try:
            while len(collected) < layout.world_size:
                try:
                    rank, ok, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(set(range(layout.world_size)) - set(collected))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s} s") from None
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for process in processes:
                process.join(
                    timeout=max(0.0, deadline - time.monotonic()) if len(collected) == layout.world_size else 0
                )
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
    return [collected[rank] for rank in range(layout.world_size)]
