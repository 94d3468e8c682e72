"""The Triton kernels compile for a GPU (sm_90) with the arguments their launchers pass: the
interpreter the other tests run them under accepts code the GPU compiler may not. A subset of
triton_compile_check.py's variants (the script compiles them all, and for other capabilities)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("triton_compile_check.py")
# The production dtype's kernels in every mode, float32's IEEE dots, the 8-bit pools' paths, and
# the FP8 weights' block-scaled GEMM.
VARIANTS = [
    "write bfloat16",
    "decode bfloat16 indexed split block12",
    "merge bfloat16",
    "prefill bfloat16",
    "decode float32",
    "prefill float32 fresh",
    "write int8",
    "decode int8",
    "write float8_e4m3fn",
    "prefill float8_e4m3fn",
    "fp8 gemm bfloat16 rows3",
    "fp8 gemm bfloat16 rows100",
]


def test_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", ",".join(VARIANTS), "90"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok   sm_90") == len(VARIANTS), result.stdout
