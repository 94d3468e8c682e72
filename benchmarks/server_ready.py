"""Server start-up: seconds from `servelm serve` to its first 200 on /ready, per checkpoint.

What a user waits for after a deploy or a crash, and what every test that starts a server pays:
the API process's imports and tokenizer, the engine core's spawn, imports, load and warm-up.
Each (system, checkpoint) is started once untimed first (kernel builds and the tokenizer caches
filled: the steady state of a host that has served the model before), then `--repeats` timed
starts, systems interleaved round by round; medians, since one start on a shared VM varies.

    tiny      a tiny random Llama as a Hugging Face directory (SmolLM2's tokenizer; the tests' model)
    default   the embedded default model (SmolLM2-135M Q4_1 GGUF)

    .venv/bin/python benchmarks/server_ready.py --repeats 5
    .venv/bin/python benchmarks/server_ready.py --repeats 5 --baseline-src ../base/src   # another checkout beside it
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from servelm.server.launcher import launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

SERVER_ARGS = ["--num-blocks", "256"]
_CORE_READY = re.compile(r"engine ready ([\d.]+) s after its launch \(([\d.]+) s of it before the first phase")


def start_once(model: Path | None, src: str | None) -> tuple[float, float, float]:
    """(seconds to /ready, the core's seconds from launch to ready, of which spawn and imports)."""
    env = {"PYTHONPATH": src} if src else {}
    started = time.perf_counter()
    server = launch_server(model, SERVER_ARGS, env=env)
    ready_s = time.perf_counter() - started
    server.stop()
    match = _CORE_READY.search(server.log_tail(20000))
    core_s, imports_s = (float(match.group(1)), float(match.group(2))) if match else (float("nan"), float("nan"))
    os.unlink(server.log_path)
    return ready_s, core_s, imports_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-src", default=None, help="another checkout's src/, started the same way")
    parser.add_argument("--models", default="tiny,default")
    args = parser.parse_args()
    tiny = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="server-ready-")) / "model", seed=0)
    models = {"tiny": tiny, "default": None}
    systems = {"this checkout": None, **({"baseline": args.baseline_src} if args.baseline_src else {})}
    cases = [(m, s) for m in args.models.split(",") for s in systems]
    for model, system in cases:  # untimed: fills the kernel and tokenizer caches
        start_once(models[model], systems[system])
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for model, system in cases:
            results[model, system].append(start_once(models[model], systems[system]))
    print("| checkpoint | system | to /ready s (median) | min–max | core launch→ready s | of it spawn + imports s |")
    print("|---|---|---:|---|---:|---:|")
    for (model, system), runs in results.items():
        ready = [r[0] for r in runs]
        print(f"| {model} | {system} | {statistics.median(ready):.2f} | {min(ready):.2f}–{max(ready):.2f} | "
              f"{statistics.median(r[1] for r in runs):.2f} | {statistics.median(r[2] for r in runs):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
