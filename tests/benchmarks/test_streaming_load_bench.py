"""benchmarks/streaming_load.py runs end to end at a tiny size: a ~40 MB checkpoint downloaded,
loaded, and streamed (each in a fresh process), its ratios in the JSON."""

import json
from pathlib import Path

from servelm.testing.benchmark_script import run_benchmark_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_streaming_load_benchmark_measures_download_load_and_streamed(tmp_path):
    out = tmp_path / "streaming.json"
    completed = run_benchmark_script(
        ROOT / "benchmarks" / "streaming_load.py",
        ["--model-gb", "0.04", "--hidden-size", "256", "--rate-mb-s", "100", "--cache-dir", str(tmp_path / "cache"),
         "--out", str(out)],
        timeout_s=180,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["download_s"] > 0 and report["load_s"] > 0 and report["stream_ready_s"] > 0
    # The ratio is the benchmark's figure (benchmarks/RESULTS.md), not bounded here: at this size
    # process start-up dominates all three, and a busy host took it to 2.25 in a full suite run.
    assert report["ratio_to_sum"] > 0 and "max(download, load)" in completed.stdout
