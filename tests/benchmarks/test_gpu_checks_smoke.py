"""benchmarks/gpu_checks.py is what a session with a lent GPU runs first: keep it working.
On CPU with the tiny shape it runs every check but the default model's exactness (tests/models
covers that on CPU) and the CUDA-only ones (the roofline figures mean nothing here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_checks.py"


@pytest.mark.slow
def test_gpu_checks_run_on_cpu_and_pass_their_exactness_checks(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--batches", "1,4", "--kv-gib", "0.25",
         "--no-default-model"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "gpu_checks.md").read_text()
    # Two exactness rows (float32, bfloat16), two Triton-vs-torch attention rows, one FP8 GEMM row (interpreter).
    assert report.count("| PASS |") == 5 and "FAIL" not in report
    assert "FP8 block GEMM" in report
    assert "| 4 |" in report and "total tokens/s" in report
    results = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert results["passed"] and len(results["exactness"]) == 2 and len(results["kernels"]["attention"]) == 2
    assert [r["batch"] for r in results["decode"]["batches"]] == [1, 4]
    assert results["prefill"]["tokens_per_s"] > 0 and results["offline"]["output_tokens"] == 64 * 128
