"""Streaming load (issue 16, performance): a remote --model is ready within 1.2x of
max(download, load), where pulling first and loading after takes download + load.

    python benchmarks/streaming_load.py --out /tmp/streaming_load.json
    python benchmarks/streaming_load.py --model-gb 0.1 --out /tmp/streaming-smoke.json   # a smoke run

Checkpoint: benchmarks/delivery.py's synthetic Llama-shaped bf16 one (cached in --cache-dir).
Origin: `python -m servelm.delivery.file_server --rate-mb-s R` (200 MB/s as in delivery.py).
Three measurements, each in a fresh process (a cold engine, the same flags):

    download  `servelm pull ORIGIN --to DIR`: the pull's own seconds
    load      the engine built from DIR (now on local disk, in the page cache): its `load` phase
    stream    the engine built from --model ORIGIN: from the pull's start to the end of the
              later of `fetch` and `load` (ready to size KV and serve)

The engine loads into float32 on CPU (the default here): each bf16 tensor is converted as it is
copied, so `load` is a real conversion, not a memory map.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from delivery import checkpoint  # noqa: E402 - benchmarks/ is not a package; the shared checkpoint writer

from servelm.ports import free_port  # noqa: E402

_BUILD = """
import json, sys, time
from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.obs.startup import StartupTimeline
startup = StartupTimeline()
flat = json.loads(sys.argv[1])
build_engine(EngineConfig.from_flat(**flat), startup=startup)
print(json.dumps([[r.name, r.started_at, r.seconds] for r in startup.records]))
"""


def build_phases(flat: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Build an engine in a fresh process; (started_at, seconds) per phase."""
    done = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(flat)], capture_output=True, text=True, check=True)
    return {name: (started, seconds) for name, started, seconds in json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-gb", type=float, default=2.0)
    parser.add_argument("--hidden-size", type=int, default=2048, help="a multiple of 256 (smaller: smoke runs)")
    parser.add_argument("--rate-mb-s", type=float, default=200.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "servelm-bench-delivery")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model = checkpoint(args.cache_dir, args.model_gb, args.hidden_size)
    model_bytes = sum(p.stat().st_size for p in model.iterdir() if p.is_file())
    port = free_port()
    origin = subprocess.Popen([sys.executable, "-m", "servelm.delivery.file_server", str(model), "--port", str(port),
                               "--rate-mb-s", str(args.rate_mb_s)], stdout=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    work = Path(tempfile.mkdtemp(prefix="streaming-load-"))
    try:
        time.sleep(1.0)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "servelm.cli", "pull", url, "--to", str(work / "pulled"), "--no-progress",
                        "--connections", str(args.connections)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        download_s = time.perf_counter() - started
        common = {"num_blocks": 16, "pull_connections": args.connections}
        load_s = build_phases({**common, "model": str(work / "pulled")})["load"][1]
        phases = build_phases({**common, "model": url, "download_dir": str(work / "downloads")})
        (fetch_at, fetch_s), (load_at, stream_load_s) = phases["fetch"], phases["load"]
        stream_s = max(fetch_at + fetch_s, load_at + stream_load_s) - fetch_at
    finally:
        origin.terminate()
        origin.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model_bytes": model_bytes,
        "origin_rate_mb_s": args.rate_mb_s,
        "download_s": download_s,
        "load_s": load_s,
        "stream_ready_s": stream_s,
        "stream_fetch_s": fetch_s,
        "stream_load_s": stream_load_s,
        "ratio_to_max": stream_s / max(download_s, load_s),
        "ratio_to_sum": stream_s / (download_s + load_s),
    }
    print(f"model {model_bytes / 1e9:.2f} GB, origin {args.rate_mb_s:.0f} MB/s")
    print(f"download alone {download_s:.1f} s, load alone {load_s:.1f} s, pull-then-load {download_s + load_s:.1f} s")
    print(f"streamed: ready {stream_s:.1f} s (fetch {fetch_s:.1f} s, load {stream_load_s:.1f} s overlapping) = "
          f"{report['ratio_to_max']:.2f}x max(download, load) (target <= 1.2x), "
          f"{report['ratio_to_sum']:.2f}x pull-then-load")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
