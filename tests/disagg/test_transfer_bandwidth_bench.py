"""benchmarks/kv_transfer_bandwidth.py runs end to end at a tiny size: two processes, both
transports, a memcpy baseline, its JSON (the script checks the pulled bytes itself)."""

import json
from pathlib import Path

from servelm.testing.benchmark_script import run_benchmark_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_bandwidth_benchmark_pulls_over_tcp_and_ipc_and_writes_its_json(tmp_path):
    out = tmp_path / "kv-transfer.json"
    completed = run_benchmark_script(
        ROOT / "benchmarks" / "kv_transfer_bandwidth.py",
        ["--num-blocks", "4", "--reps", "2",
         "--out", str(out)],
        timeout_s=120,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["block_bytes"] == 737_280 and report["num_blocks"] == 4
    for path in ("memcpy", "tcp", "ipc"):
        assert report["results"][path]["median_gbps"] > 0
    assert "pull tcp://127.0.0.1" in completed.stdout
