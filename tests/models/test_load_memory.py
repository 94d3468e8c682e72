"""Loading a checkpoint into a bf16 model holds the weights once: from a bf16 file peak host
memory grows by at most 1.3x the file size (no float32 copy, no whole checkpoint held twice);
from a float32 file by at most the bf16 model plus a quarter of the file (each tensor is read and
converted alone: no float32 copy of the whole model is ever made before the model's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from servelm.testing.tiny_model import write_random_checkpoint

# Runs in a fresh interpreter, so the peak RSS is this load's and nothing else's.
_MEASURE = """
import json, os, sys
import torch
from servelm.models.factory import build_model
from servelm.models.hf_loader import load_hf_tokenizer
from servelm.models.loader import load_checkpoint

path = sys.argv[1]
load_hf_tokenizer(__import__("pathlib").Path(path))  # import and warm the tokenizer stack first

def rss_bytes():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss_bytes()
checkpoint = load_checkpoint(path)
model = build_model(checkpoint.arch, checkpoint.weights, torch.bfloat16, "cpu")
# VmHWM, not ru_maxrss: getrusage's maximum survives execve, so it would include the RSS this
# child had as a fork of the (large) pytest process; the high-water mark of the new image does not.
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
params = sum(p.numel() * p.element_size() for p in model.parameters())
assert all(p.dtype == torch.bfloat16 for p in model.parameters())
print(json.dumps({"before": before, "peak": peak, "param_bytes": params}))
"""


def _measure_load(directory: Path) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(directory)], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bf16_load_peak_memory_is_at_most_1_3x_the_file(tmp_path: Path):
    directory = write_random_checkpoint(tmp_path / "smollm2-shaped-bf16")
    file_bytes = (directory / "model.safetensors").stat().st_size
    assert file_bytes > 200e6  # SmolLM2-135M's shape in bf16: ~270 MB
    measured = _measure_load(directory)
    growth = measured["peak"] - measured["before"]
    assert measured["param_bytes"] <= file_bytes  # the model itself is one copy of the file's tensors
    assert growth <= 1.3 * file_bytes, f"peak RSS grew {growth / 1e6:.0f} MB for a {file_bytes / 1e6:.0f} MB file"


def test_float32_file_into_bf16_model_converts_tensor_by_tensor(tmp_path: Path):
    # Four SmolLM2-shaped layers with a small vocabulary: ~61 MB of float32, no tensor above 4 MB,
    # so a whole float32 copy (the file's size again) would overshoot the bound by ~15 MB at least.
    directory = write_random_checkpoint(tmp_path / "f32", dtype=torch.float32, vocab_size=2048, num_hidden_layers=4)
    file_bytes = (directory / "model.safetensors").stat().st_size
    measured = _measure_load(directory)
    growth = measured["peak"] - measured["before"]
    assert abs(2 * measured["param_bytes"] - file_bytes) < 0.01 * file_bytes  # the model is the file in bf16
    assert growth <= measured["param_bytes"] + file_bytes / 4, (
        f"peak RSS grew {growth / 1e6:.0f} MB loading a {file_bytes / 1e6:.0f} MB float32 file into a "
        f"{measured['param_bytes'] / 1e6:.0f} MB bf16 model"
    )
