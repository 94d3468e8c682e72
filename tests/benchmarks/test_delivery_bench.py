"""benchmarks/delivery.py runs end to end at a tiny size: a ~40 MB checkpoint, two nodes of each
system, its table and JSON (the script itself checks that every node holds a complete copy)."""

import json
from pathlib import Path

from servelm.testing.benchmark_script import run_benchmark_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_delivery_benchmark_compares_the_swarm_with_naive_pulls(tmp_path):
    out = tmp_path / "delivery.json"
    completed = run_benchmark_script(
        ROOT / "benchmarks" / "delivery.py",
        ["--model-gb", "0.04", "--hidden-size", "256",
         "--nodes", "2", "--rate-mb-s", "100", "--cache-dir", str(tmp_path / "cache"), "--disk-test-mb", "16",
         "--out", str(out)],
        timeout_s=180,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {run["system"]: run for run in report["runs"]}
    assert runs["swarm"]["nodes"] == runs["naive"]["nodes"] == 2
    assert runs["swarm"]["origin_ratio"] <= 1.05, "two swarm nodes fetch the model from the origin once"
    assert runs["naive"]["origin_ratio"] >= 1.95, "two naive nodes fetch it twice"
    assert sum(runs["swarm"]["node_origin_bytes"]) == runs["swarm"]["origin_bytes"]
    assert report["extrapolation"]["swarm_s"] > 0 and "bound by" in completed.stdout
