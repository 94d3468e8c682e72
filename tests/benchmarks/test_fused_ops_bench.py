"""benchmarks/fused_ops_bench.py's fused_op_microbench (the lead's GPU check calls it) runs and checks
what it times: here on CPU, the Triton side under the interpreter, on a small shape."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from servelm.testing.benchmark_script import load_benchmark_script

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported

bench = load_benchmark_script(Path(__file__).resolve().parents[2] / "benchmarks" / "fused_ops_bench.py",
                              "fused_ops_bench")  # fmt: skip


def test_microbench_times_both_sides_of_each_op_and_their_outputs_agree():
    shape = bench.Shape("small", 96, 3 + 1, 16, 10000.0)
    result = bench.fused_op_microbench("cpu", shapes=[shape], token_counts=[1, 5], iterations=1)

    assert result["device"] == "cpu" and result["dtype"] == "bfloat16"
    assert [(r["op"], r["tokens"]) for r in result["rows"]] == [
        ("add_rms_norm", 1), ("rotate", 1), ("add_rms_norm", 5), ("rotate", 5)
    ]  # fmt: skip
    for row in result["rows"]:
        assert row["torch_eager_us"] > 0 and row["triton_eager_us"] > 0
        assert row["torch_graph_us"] is None and row["triton_graph_us"] is None  # no CUDA graphs on CPU
        assert 0 <= row["max_abs_diff"] < 0.07  # bf16 outputs of values ~1: a rounding step or two
    assert result["rows"][0]["bytes"] == 4 * 96 * 2  # x, residual in; out, sum out; bf16
    table = bench.markdown(result)
    assert table.count("| add_rms_norm | small |") == 2 and "| rotate | small | 5 |" in table
