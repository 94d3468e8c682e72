"""KV transfer bandwidth (issue 14): a consumer pulls N blocks from a producer in another process,
over tcp://127.0.0.1 and ipc://, against this machine's memory-copy bandwidth measured in the same run.

    python benchmarks/kv_transfer_bandwidth.py --out /tmp/kv-transfer.json
    python benchmarks/kv_transfer_bandwidth.py --num-blocks 256 --reps 10

Blocks are the default model's (SmolLM2-135M, fp32 KV: 30 layers x K,V x 16 tokens x 3 KV heads x
64 dims x 4 bytes = 737,280 bytes) filled with random bytes. The producer (a spawned process: the
real KVTransferServer and ExportRegistry over a dict host store) has them all saved and its export
complete; the consumer (the real KVTransferClient) times one pull of all N blocks from `start` to
its on_end, every block crc32-verified and copied into a destination array as the runner would
unpack it into its pool. memcpy: numpy.copyto of the same N x block bytes, one process. Each figure
is the median (and best) of --reps runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import platform
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from servelm.datatypes import KVExportEnd
from servelm.disagg.exports import ExportRegistry
from servelm.disagg.transport import KVTransferClient, KVTransferServer

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
TRANSFER_ID = "bench"


def block_hashes(num_blocks: int) -> list[bytes]:
    return [index.to_bytes(32, "little") for index in range(num_blocks)]


def producer_main(
    num_blocks: int,
    ipc_path: str,
    addresses: multiprocessing.queues.Queue[tuple[str, str | None]],
    stop: multiprocessing.synchronize.Event,
) -> None:
    payloads = np.random.default_rng(0).integers(0, 256, (num_blocks, BLOCK_BYTES), dtype=np.uint8)
    store = {block_hash: memoryview(payloads[index]) for index, block_hash in enumerate(block_hashes(num_blocks))}
    registry = ExportRegistry(store.get, wait_s=5.0)
    server = KVTransferServer(registry, ipc_path=ipc_path)
    registry.announce(TRANSFER_ID, block_hashes(num_blocks))
    registry.end(TRANSFER_ID, KVExportEnd.COMPLETE)
    addresses.put((server.address, server.ipc_address))
    stop.wait()
    server.close()


def time_pulls(address: str, num_blocks: int, reps: int) -> list[float]:
    """Seconds of each of `reps` pulls of all blocks (after one warm-up)."""
    destination = np.empty((num_blocks, BLOCK_BYTES), dtype=np.uint8)  # the consumer's "pool"
    ended = threading.Event()
    failures: list[str | None] = []

    def on_block(key: str, index: int, payload: memoryview) -> None:
        destination[index] = np.frombuffer(payload, dtype=np.uint8)

    def on_end(key: str, failure: str | None) -> None:
        failures.append(failure)
        ended.set()

    client = KVTransferClient(BLOCK_BYTES, wait_s=5.0, on_block=on_block, on_end=on_end)
    client.connect(address)
    seconds = []
    try:
        for rep in range(reps + 1):
            ended.clear()
            started = time.perf_counter()
            client.start(f"pull-{rep}", address, TRANSFER_ID, block_hashes(num_blocks), time.monotonic() + 60)
            if not ended.wait(60) or failures[-1] is not None:
                raise RuntimeError(f"pull from {address} failed: {failures[-1:] or 'no end in 60 s'}")
            if rep:  # rep 0 warms the connection up
                seconds.append(time.perf_counter() - started)
    finally:
        client.close()
    expected = np.random.default_rng(0).integers(0, 256, (num_blocks, BLOCK_BYTES), dtype=np.uint8)
    if not np.array_equal(destination, expected):
        raise RuntimeError(f"pull from {address}: the blocks that arrived differ from the producer's")
    return seconds


def time_memcpy(num_blocks: int, reps: int) -> list[float]:
    source = np.random.default_rng(1).integers(0, 256, (num_blocks, BLOCK_BYTES), dtype=np.uint8)
    destination = np.empty_like(source)
    np.copyto(destination, source)  # fault the pages in
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        np.copyto(destination, source)
        seconds.append(time.perf_counter() - started)
    return seconds


def summary(seconds: list[float], num_bytes: int) -> dict[str, float]:
    return {
        "median_gbps": num_bytes / statistics.median(seconds) / 1e9,
        "best_gbps": num_bytes / min(seconds) / 1e9,
        "median_ms": statistics.median(seconds) * 1e3,
    }


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=64, help="blocks per pull (default 64: 47 MB)")
    parser.add_argument("--reps", type=int, default=5, help="timed pulls per transport (after one warm-up)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.num_blocks <= 0 or args.reps <= 0:
        parser.error("--num-blocks and --reps must be positive")
    num_bytes = args.num_blocks * BLOCK_BYTES

    context = multiprocessing.get_context("spawn")
    addresses: multiprocessing.queues.Queue[tuple[str, str | None]] = context.Queue()
    stop = context.Event()
    with tempfile.TemporaryDirectory() as directory:
        producer = context.Process(
            target=producer_main, args=(args.num_blocks, f"{directory}/kv.ipc", addresses, stop), daemon=True
        )
        producer.start()
        try:
            tcp_address, ipc_address = addresses.get(timeout=60)
            assert ipc_address is not None
            results = {
                "memcpy": summary(time_memcpy(args.num_blocks, args.reps), num_bytes),
                "tcp": summary(time_pulls(tcp_address, args.num_blocks, args.reps), num_bytes),
                "ipc": summary(time_pulls(ipc_address, args.num_blocks, args.reps), num_bytes),
            }
        finally:
            stop.set()
            producer.join(timeout=10)

    report = {
        "cpu": cpu_model(),
        "num_cpus": multiprocessing.cpu_count(),
        "block_bytes": BLOCK_BYTES,
        "num_blocks": args.num_blocks,
        "reps": args.reps,
        "results": results,
    }
    print(f"{args.num_blocks} blocks x {BLOCK_BYTES:,} B = {num_bytes / 1e6:.1f} MB per pull; {report['cpu']}")
    print(f"{'path':<28} {'median GB/s':>12} {'best GB/s':>10} {'median ms':>10} {'vs memcpy':>10}")
    for name, label in (
        ("memcpy", "memcpy (numpy, 1 process)"),
        ("tcp", "pull tcp://127.0.0.1"),
        ("ipc", "pull ipc://"),
    ):
        row = results[name]
        ratio = row["median_gbps"] / results["memcpy"]["median_gbps"]
        print(
            f"{label:<28} {row['median_gbps']:>12.2f} {row['best_gbps']:>10.2f} {row['median_ms']:>10.1f} {ratio:>9.0%}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
