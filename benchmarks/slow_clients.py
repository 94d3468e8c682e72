"""Clients that never read their streams: what they cost the API process, with and without the guard.

    python benchmarks/slow_clients.py                 # defaults: 4 stalled clients, 40 s per setting

Each setting starts a fresh `servelm serve` on a tiny random Llama with a 4096-token context,
opens `--clients` raw sockets that send a heavy streaming request and never read (HEAVY_STREAM:
16 choices echoing a 900-token prompt with 20 logprobs, ~7 MB at once, so the socket buffers are
full from the start; then `--max-tokens` steps of 16 outputs each), and samples for `--seconds`: the API
process's RSS, the engine outputs queued in it (servelm:num_outputs_queued_in_api), the requests
it still holds (servelm:num_requests_in_api) and the KV blocks in use. Settings:

    off       --stream-stall-timeout-s 0 --max-stream-backlog 0   (what the server did before)
    stall     --stream-stall-timeout-s 10 --max-stream-backlog 0
    default   --stream-stall-timeout-s 30 --max-stream-backlog 4096
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from servelm.server.launcher import launch_server
from servelm.testing.overload import HEAVY_STREAM, StalledStream, rss_bytes
from servelm.testing.tiny_model import write_tiny_checkpoint

SETTINGS = {
    "off": ["--stream-stall-timeout-s", "0", "--max-stream-backlog", "0"],
    "stall": ["--stream-stall-timeout-s", "10", "--max-stream-backlog", "0"],
    "default": [],
}
GAUGES = ("servelm:num_outputs_queued_in_api", "servelm:num_requests_in_api", "servelm:kv_cache_used_blocks")


def _gauges(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GAUGES:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def run_setting(model: Path, name: str, args: argparse.Namespace) -> dict[str, float]:
    server = launch_server(model, ["--num-blocks", "20000", "--num-threads", "1", "--max-num-seqs", "128", *SETTINGS[name]])
    body = {**HEAVY_STREAM, "max_tokens": args.max_tokens}
    try:
        before = rss_bytes(server.process.pid)
        clients = [StalledStream.open(server.port, "/v1/completions", body) for _ in range(args.clients)]
        peak_rss, peak_queued, started = before, 0.0, time.monotonic()
        while time.monotonic() - started < args.seconds:
            time.sleep(0.5)
            peak_rss = max(peak_rss, rss_bytes(server.process.pid))
            peak_queued = max(peak_queued, _gauges(server.base_url)["servelm:num_outputs_queued_in_api"])
        end = _gauges(server.base_url)
        for client in clients:
            client.close()
        return {"rss_growth_mb": (peak_rss - before) / 2**20, "peak_outputs_queued": peak_queued,
                "held_at_end": end["servelm:num_requests_in_api"], "kv_blocks_at_end": end["servelm:kv_cache_used_blocks"]}  # fmt: skip
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=40.0, help="how long each setting is watched")
    parser.add_argument("--max-tokens", type=int, default=3000, help="at most 4096 - 900 (the context)")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    model = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "model", seed=0, max_position_embeddings=4096)
    print(f"{'setting':<8} {'RSS growth MB':>13} {'peak outputs queued':>19} {'requests held at end':>20} {'KV blocks at end':>16}")
    for name in args.settings.split(","):
        r = run_setting(model, name, args)
        print(f"{name:<8} {r['rss_growth_mb']:>13.0f} {r['peak_outputs_queued']:>19.0f} {r['held_at_end']:>20.0f} "
              f"{r['kv_blocks_at_end']:>16.0f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
