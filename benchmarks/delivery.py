"""Model delivery to N nodes (issue 16, performance): servelm's swarm against every node
downloading everything from the origin, then an extrapolation to 700 GB on 16 nodes.

    python benchmarks/delivery.py --out /tmp/delivery.json
    python benchmarks/delivery.py --model-gb 0.1 --nodes 1,2 --out /tmp/delivery-smoke.json   # a smoke run

Checkpoint: a synthetic Llama-shaped one (random bf16; hidden 2048, 32 heads over 8 KV heads, MLP
8192 as Llama-3.2-1B's layers, SmolLM2's vocabulary 49152 and tokenizer, tied embedding; as many
layers as fill --model-gb, at least one) in shards of at most 512 MB, with its manifest (16 MiB chunks), written once into
--cache-dir. Origin: `python -m servelm.delivery.file_server --rate-mb-s 200` (one token bucket over
all its connections, as an origin's link). Nodes: N `servelm pull` processes on this machine, into
directories under --work-dir, deleted after each run.

    swarm  servelm pull ORIGIN --peers URL,... --node-index I: a node reads its share (chunk
           position mod N) from the origin, the rest from peers (delivery/swarm.py)
    naive  servelm pull ORIGIN, each node alone: every chunk from the origin over --connections
           parallel ranged reads (huggingface_hub-style parallel download)

Per run: time to all-ready (from launching the nodes until the last one holds every chunk: a
swarm node's completed_at, a naive node's exit), the origin's bytes sent (its own count) over the
model's, the nodes' CPU seconds (their rusage) per node and per GB received. Then what one node's
work costs on this machine (sha256 per core, one HTTP hop's CPU per GB at both ends, a request's
fixed overhead, the disk's write rate), and the bounds for 700 GB on 16 nodes with 25 GB/s links.

On a machine of few cores, N nodes share its cores and its disk: N x the model is hashed,
copied over loopback and written. Where that and not the origin bounds a run, the table says so
(cpu busy = the nodes' and the origin's CPU seconds over the run's seconds x cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from servelm.delivery.file_server import DirectoryFiles, RangeFileServer
from servelm.delivery.http_source import HttpSource
from servelm.delivery.manifest import ChunkRef, Manifest, ManifestError, read_manifest, write_manifest
from servelm.delivery.store import ChunkStore
from servelm.testing.delivery_cluster import Node, peer_urls, start_node, start_origin, stop_process
from servelm.testing.tiny_model import write_random_checkpoint

GB = 1e9
CHUNK_BYTES = 16 << 20
VOCAB = 49152


def llama_shape(hidden: int) -> dict[str, int]:
    """Llama's proportions (head_dim 64, 4 query heads per KV head, MLP 4x): hidden 2048 is Llama-3.2-1B's layer."""
    return {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_attention_heads": hidden // 64,
            "num_key_value_heads": hidden // 256}  # fmt: skip


def layer_bytes(hidden: int) -> int:  # bf16 q and o, k and v, the MLP's three, two norms
    return 2 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * 4 * hidden + 2 * hidden)


@dataclass
class Run:
    system: str
    nodes: int
    all_ready_s: float
    origin_bytes: int
    origin_ratio: float  # origin bytes / model bytes
    node_cpu_s: float  # all nodes together
    node_cpu_s_per_gb: float  # per GB a node received, its start-up taken off
    origin_cpu_s: float
    cpu_busy: float  # (nodes' + origin's CPU s) / (run s x cores): near 1, the cores bound the run
    node_origin_bytes: list[int]  # per node, from its --stats-json (swarm only)
    node_peer_bytes: list[int]


def checkpoint(cache_dir: Path, model_gb: float, hidden: int) -> Path:
    """The cached checkpoint of ~model_gb (tied embedding, at least one layer), written (with its
    manifest) on first use."""
    layers = max(1, round((model_gb * GB - 2 * VOCAB * hidden) / layer_bytes(hidden)))
    directory = cache_dir / f"llama-h{hidden}-l{layers}-bf16"
    try:
        read_manifest(directory)
        return directory
    except ManifestError:
        pass
    shutil.rmtree(directory, ignore_errors=True)
    print(f"writing a {layers}-layer checkpoint into {directory} (once)", flush=True)
    write_random_checkpoint(directory, num_hidden_layers=layers, max_shard_bytes=512 << 20, **llama_shape(hidden))
    write_manifest(directory, CHUNK_BYTES)
    return directory


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def startup_cpu_s() -> float:
    """What a node process spends before its first byte (interpreter, imports, parsing its flags),
    taken off the nodes' CPU before dividing by the bytes they received."""
    before = children_cpu_s()
    subprocess.run([sys.executable, "-m", "servelm.cli", "pull", "--help"], capture_output=True, check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)  # fmt: skip
    return children_cpu_s() - before


def wait_exits(nodes: list[Node], timeout_s: float) -> list[float]:
    """Each node's exit time (time.time()); RuntimeError with its log for a failed or stuck one."""
    exits: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(exits) < len(nodes):
        for index, node in enumerate(nodes):
            if index not in exits and node.process.poll() is not None:
                exits[index] = time.time()
                if node.process.returncode != 0:
                    raise RuntimeError(f"{node.log_path.name} exited {node.process.returncode}:\n{node.log()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nodes still running after {timeout_s} s: {node.log()[-2000:]}")
        time.sleep(0.01)
    return [exits[index] for index in range(len(nodes))]


def run_once(system: str, count: int, model: Path, args: argparse.Namespace, startup_s: float) -> Run:
    manifest = read_manifest(model)
    work = Path(tempfile.mkdtemp(prefix=f"{system}{count}-", dir=args.work_dir))
    origin = start_origin(model, args.rate_mb_s)
    cpu_before = children_cpu_s()
    nodes: list[Node] = []
    try:
        started = time.time()
        if system == "swarm":
            peers = peer_urls(count)
            flags = ["--origin-connections", str(args.origin_connections), "--connections", str(args.connections)]
            nodes = [start_node(origin.url, work / f"n{i}", work / "logs", peers, i, flags) for i in range(count)]
        else:
            flags = ["--connections", str(args.connections)]
            nodes = [start_node(origin.url, work / f"n{i}", work / "logs", extra=flags, name=f"naive{i}")
                     for i in range(count)]  # fmt: skip
        exits = wait_exits(nodes, args.timeout_s)
        stats = [node.stats() for node in nodes] if system == "swarm" else []
        ready = [s["completed_at"] for s in stats if s is not None] if system == "swarm" else exits
        for node in nodes:
            if ChunkStore.complete_manifest(node.directory) != manifest:
                raise RuntimeError(f"{node.directory} is not a complete copy:\n{node.log()[-2000:]}")
        origin_bytes = origin.bytes_sent()
        node_cpu = children_cpu_s() - cpu_before
    finally:
        for node in nodes:
            stop_process(node.process)
        origin.stop()
        shutil.rmtree(work, ignore_errors=True)
    origin_cpu = children_cpu_s() - cpu_before - node_cpu
    seconds = max(ready) - started
    size = manifest.total_bytes
    return Run(
        system, count, seconds, origin_bytes, origin_bytes / size, node_cpu,
        max(0.0, node_cpu - count * startup_s) / (count * size / GB),
        origin_cpu, (node_cpu + origin_cpu) / (seconds * (os.cpu_count() or 1)),
        [s["origin_bytes"] for s in stats if s], [s["peer_bytes"] for s in stats if s],
    )  # fmt: skip


# --- what one node's work costs here, for the extrapolation ----------------------------------


def sha256_gb_s() -> float:
    block = os.urandom(CHUNK_BYTES)
    started = time.perf_counter()
    for _ in range(16):
        hashlib.sha256(block).digest()
    return 16 * CHUNK_BYTES / (time.perf_counter() - started) / GB


def hop_costs(model: Path, manifest: Manifest) -> dict[str, float]:
    """One HTTP hop, both ends in this process (a RangeFileServer thread and an HttpSource, one
    connection, uncapped): CPU seconds and wall seconds per GB over 16 MiB chunks, and a 1-byte
    request's round trip (the fixed cost every chunk pays)."""
    server = RangeFileServer(DirectoryFiles(model)).start()
    source = HttpSource(server.url, connections=1)
    chunks = sorted(manifest.chunks(), key=lambda chunk: chunk.length, reverse=True)[:24]  # full ones
    try:
        source.read(chunks[0])  # connect, fault the file into the page cache
        for chunk in chunks:
            source.read(chunk)
        cpu, wall = time.process_time(), time.perf_counter()
        for chunk in chunks:
            source.read(chunk)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        tiny = ChunkRef(chunks[0].file, 0, 0, 1, "")
        started = time.perf_counter()
        for _ in range(200):
            source.read(tiny)
        request_s = (time.perf_counter() - started) / 200
    finally:
        source.close()
        server.stop()
    gigabytes = sum(chunk.length for chunk in chunks) / GB
    return {"hop_cpu_s_per_gb": cpu / gigabytes, "hop_wall_s_per_gb": wall / gigabytes, "request_s": request_s}


def disk_write_gb_s(work_dir: Path | None, size: int) -> float:
    """Writing `size` bytes and fdatasync (the store syncs every few seconds: a pull writes at the disk's pace)."""
    block = os.urandom(CHUNK_BYTES)
    with tempfile.NamedTemporaryFile(dir=work_dir) as f:
        started = time.perf_counter()
        for _ in range(size // CHUNK_BYTES):
            f.write(block)
        f.flush()
        os.fdatasync(f.fileno())
        return size / (time.perf_counter() - started) / GB


def extrapolate(costs: dict[str, float], swarm_runs: list[Run], args: argparse.Namespace) -> dict[str, object]:
    """Seconds each resource needs for a swarm of `args.big_nodes` to deliver `args.big_gb`; the
    pipeline runs them all at once, so the largest bounds the time (plus a chunk's trip, ~ms)."""
    size, n, link, cores = args.big_gb, args.big_nodes, args.link_gb_s, args.big_cores
    chunks = size * GB / CHUNK_BYTES
    received, sent = size, size * (n - 1) / n  # per node: everything in; its share to n-1 peers out
    origin_ratio = max([run.origin_ratio for run in swarm_runs] or [1.0])
    # A node's whole work as measured here (hashing, receiving, serving, writing, polling), per GB it received.
    node_cpu = max([run.node_cpu_s_per_gb for run in swarm_runs if run.nodes > 1] or [costs["hop_cpu_s_per_gb"]])
    bounds = {
        "origin egress (origin link)": size * origin_ratio / link,
        "node NIC in": received / link,
        "node NIC out": sent / link,
        "disk write (as measured here)": received / costs["disk_write_gb_s"],
        f"disk write at {args.big_disk_gb_s:g} GB/s (NVMe)": received / args.big_disk_gb_s,
        f"sha256 alone on {cores} cores": received / (costs["sha256_gb_s"] * cores),
        f"a node's work ({node_cpu:.2f} CPU s/GB) on {cores} cores": received * node_cpu / cores,
        "request overheads (per connection)": chunks * costs["request_s"] / (args.connections + args.origin_connections),
    }
    naive = {"origin egress (origin link)": n * size / link, "node NIC in": received / link}
    local = {k: v for k, v in bounds.items() if k != "disk write (as measured here)"}
    bound = max(local, key=lambda k: local[k])
    return {"model_gb": size, "nodes": n, "link_gb_s": link, "cores_per_node": cores, "chunks": chunks,
            "swarm_bounds_s": bounds, "swarm_s": local[bound], "swarm_bound": bound,
            "naive_bounds_s": naive, "naive_s": max(naive.values())}  # fmt: skip


def print_report(report: dict[str, Any]) -> None:
    runs = [Run(**r) for r in report["runs"]]
    print(f"\nmodel {report['model_bytes'] / GB:.2f} GB ({report['chunks']} chunks), origin capped at "
          f"{report['rate_mb_s']} MB/s, {report['cores']} cores; {report['cpu']}")  # fmt: skip
    print(f"{'system':<7}{'N':>3}{'all-ready s':>13}{'vs N=1':>8}{'origin x':>10}{'node cpu s':>12}"
          f"{'cpu s/GB':>10}{'origin cpu s':>14}{'cpu busy':>10}")  # fmt: skip
    first = {run.system: run.all_ready_s for run in runs if run.nodes == 1}
    for run in runs:
        ratio = run.all_ready_s / first[run.system] if run.system in first else float("nan")
        print(f"{run.system:<7}{run.nodes:>3}{run.all_ready_s:>13.1f}{ratio:>8.2f}{run.origin_ratio:>10.3f}"
              f"{run.node_cpu_s:>12.1f}{run.node_cpu_s_per_gb:>10.2f}{run.origin_cpu_s:>14.1f}{run.cpu_busy:>10.0%}")  # fmt: skip
    costs = report["costs"]
    print(f"\nhere: sha256 {costs['sha256_gb_s']:.2f} GB/s per core; one HTTP hop {costs['hop_cpu_s_per_gb']:.2f} "
          f"CPU s/GB (both ends), {1 / costs['hop_wall_s_per_gb']:.2f} GB/s on one connection; a request "
          f"{costs['request_s'] * 1e3:.2f} ms; disk write {costs['disk_write_gb_s']:.2f} GB/s")
    big = report["extrapolation"]
    print(f"\n{big['model_gb']:g} GB to {big['nodes']} nodes, {big['link_gb_s']:g} GB/s links, "
          f"{big['cores_per_node']} cores per node ({big['chunks']:.0f} chunks):")
    for name, seconds in big["swarm_bounds_s"].items():
        print(f"  swarm  {name:<38}{seconds:>9.1f} s")
    print(f"  swarm  ~{big['swarm_s']:.0f} s, bound by {big['swarm_bound']}; naive ~{big['naive_s']:.0f} s "
          f"(origin egress)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-gb", type=float, default=2.0)
    parser.add_argument("--hidden-size", type=int, default=2048, help="a multiple of 256 (smaller: smoke runs)")
    parser.add_argument("--nodes", default="1,2,4,8", help="comma-separated node counts")
    parser.add_argument("--systems", default="swarm,naive")
    parser.add_argument("--rate-mb-s", type=float, default=200.0, help="the origin's egress cap")
    parser.add_argument("--connections", type=int, default=8, help="naive: reads per node; swarm: peer reads per node")
    parser.add_argument("--origin-connections", type=int, default=2, help="swarm: origin reads per node")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "servelm-bench-delivery")
    parser.add_argument("--work-dir", type=Path, default=None, help="where nodes write (default: the cache dir)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--disk-test-mb", type=int, default=512, help="bytes written to measure the disk")
    parser.add_argument("--big-gb", type=float, default=700.0)
    parser.add_argument("--big-nodes", type=int, default=16)
    parser.add_argument("--link-gb-s", type=float, default=25.0)
    parser.add_argument("--big-cores", type=int, default=32, help="cores per node in the extrapolation")
    parser.add_argument("--big-disk-gb-s", type=float, default=6.0, help="a node's disk in the extrapolation's NVMe row")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir = args.work_dir or args.cache_dir
    systems = [s for s in args.systems.split(",") if s]
    if any(s not in ("swarm", "naive") for s in systems):
        parser.error("--systems takes swarm and/or naive")
    model = checkpoint(args.cache_dir, args.model_gb, args.hidden_size)
    manifest = read_manifest(model)

    startup_s = startup_cpu_s()
    runs = []
    for system in systems:
        for count in (int(n) for n in args.nodes.split(",")):
            run = run_once(system, count, model, args, startup_s)
            print(f"{system} N={count}: all-ready {run.all_ready_s:.1f} s, origin {run.origin_ratio:.3f}x, "
                  f"nodes' cpu {run.node_cpu_s:.1f} s, busy {run.cpu_busy:.0%}", flush=True)  # fmt: skip
            runs.append(run)
    costs = {
        "sha256_gb_s": sha256_gb_s(), **hop_costs(model, manifest), "node_startup_cpu_s": startup_s,
        "disk_write_gb_s": disk_write_gb_s(args.work_dir, args.disk_test_mb << 20),
    }  # fmt: skip
    report = {
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": sys.version.split()[0],
        "model_bytes": manifest.total_bytes, "chunks": len(manifest.chunks()), "chunk_bytes": CHUNK_BYTES,
        "rate_mb_s": args.rate_mb_s, "connections": args.connections, "origin_connections": args.origin_connections,
        "runs": [asdict(run) for run in runs], "costs": costs,
        "extrapolation": extrapolate(costs, [run for run in runs if run.system == "swarm"], args),
    }  # fmt: skip
    print_report(report)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
