"""Engine start-up: how long building an engine takes (checkpoint load / model build) and its peak host memory.

Each case runs `servelm.engine.builder.build_engine` with the real config (CPU, a small KV pool of
64 blocks) in a fresh interpreter, so its peak RSS is that build's alone:

    default   the embedded default model (SmolLM2-135M Q4_1 GGUF), dtype auto (float32 on CPU)
    bf16->f32 a random SmolLM2-shaped Llama saved as bf16 safetensors (~270 MB), loaded in float32
    bf16      the same checkpoint loaded in bfloat16

load = `load_checkpoint` (weights source and tokenizer), build = `build_model` (allocation, copying
and converting every tensor, per-layer linear methods); the rest of `build_engine` is the KV pool and
scheduler. RSS before = after imports and a tokenizer warm-up; growth = peak RSS - RSS before.
Each case runs `--repeats` times (fresh interpreters, cases interleaved); the table shows medians,
since on a shared machine a single start-up time varies by several x.

    .venv/bin/python benchmarks/startup_memory.py
    .venv/bin/python benchmarks/startup_memory.py --src /path/to/other/checkout/src   # measure another commit's code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from servelm.testing.tiny_model import write_random_checkpoint

# Runs in the child: time the two halves of build_engine by wrapping what it calls, by name.
_MEASURE = r"""
import json, os, sys, time
from pathlib import Path

from servelm.config import EngineConfig
from servelm.engine import builder
try:  # where these live since the clean-edges change (issue 10); before it, in servelm.models
    from servelm.default_model import default_model_path
    from servelm.tokenization.loading import load_gguf_tokenizer, load_hf_tokenizer
except ImportError:
    from servelm.models.default_model import default_model_path
    from servelm.models.gguf_loader import load_gguf_tokenizer
    from servelm.models.hf_loader import load_hf_tokenizer

model, dtype = (None if sys.argv[1] == "-" else sys.argv[1]), sys.argv[2]
# Import and warm the tokenizer stack first: its import cost is not the weights'.
load_gguf_tokenizer(default_model_path()) if model is None else load_hf_tokenizer(Path(model))
seconds = {}

def timed(key, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds[key] = time.perf_counter() - started
        return result
    return wrapper

builder.load_checkpoint = timed("load_s", builder.load_checkpoint)
builder.build_model = timed("build_s", builder.build_model)
page = os.sysconf("SC_PAGE_SIZE")
before = int(open("/proc/self/statm").read().split()[1]) * page
started = time.perf_counter()
engine = builder.build_engine(EngineConfig.from_flat(model=model, dtype=dtype, device="cpu", num_blocks=64))
total = time.perf_counter() - started
# VmHWM, not ru_maxrss: getrusage's maximum survives execve (it would include the parent's RSS at fork).
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({**seconds, "total_s": total, "rss_before": before, "peak_rss": peak}))
"""


def measure(model: str | None, dtype: str, src: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", _MEASURE, model or "-", dtype], capture_output=True, text=True,
                            env=env, timeout=1200)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"measuring {model or 'the default model'} ({dtype}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def table(rows: list[tuple[str, int, dict[str, float]]]) -> str:
    lines = [
        "| checkpoint | file MB | load s | model build s | build_engine s | RSS before MB | peak RSS MB | peak growth MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, file_bytes, m in rows:
        growth = m["peak_rss"] - m["rss_before"]
        lines.append(
            f"| {name} | {file_bytes / 1e6:.0f} | {m['load_s']:.2f} | {m['build_s']:.2f} | {m['total_s']:.2f} | "
            f"{m['rss_before'] / 1e6:.0f} | {m['peak_rss'] / 1e6:.0f} | {growth / 1e6:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", help="PYTHONPATH entry whose servelm the measured builds import (default: this one)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh builds per case; the table shows medians")
    args = parser.parse_args()
    from servelm.default_model import default_model_path

    with tempfile.TemporaryDirectory() as tmp:
        bf16 = write_random_checkpoint(Path(tmp) / "smollm2-shaped-bf16")
        bf16_bytes = (bf16 / "model.safetensors").stat().st_size
        cases = [
            ("default model (Q4_1 GGUF), float32", None, "auto", default_model_path().stat().st_size),
            ("SmolLM2-shaped bf16 safetensors, float32", str(bf16), "float32", bf16_bytes),
            ("SmolLM2-shaped bf16 safetensors, bfloat16", str(bf16), "bfloat16", bf16_bytes),
        ]
        runs: list[list[dict[str, float]]] = [[] for _ in cases]
        for _ in range(args.repeats):  # interleaved, so a burst of load on the machine hits every case
            for i, (_, model, dtype, _) in enumerate(cases):
                runs[i].append(measure(model, dtype, args.src))
    print(table([(name, size, median_of(runs[i])) for i, (name, _, _, size) in enumerate(cases)]))
    print(f"\nmedians of {args.repeats} fresh builds per case")


if __name__ == "__main__":
    main()
