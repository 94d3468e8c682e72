"""Suite-wide settings (no model hub is reachable, so transformers must never try one), and the tiny
checkpoint + single-sequence reference model the exactness tests share (a module may define its own
`tiny_dir`, which then wins)."""

import os
import tempfile

# The suite runs two workers on a 2-core host, and each starts servers and engines whose OpenMP
# threads (torch's, our kernels') spin between parallel regions by default: processes spinning
# against each other on two cores ran the default model's server start-up 6x slower than alone
# (warmup 17.4 s against 3.4 s; 6.9 s with PASSIVE), three default-model test files in 1.8x the
# wall time. PASSIVE threads sleep when idle: results are the same, only the waiting differs.
# Set before torch loads libgomp; xdist's workers and every server a test starts inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.testing.tiny_model import write_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Servers the tests start keep their batch jobs here, never in the user's ~/.local/share/servelm.
os.environ.setdefault("SERVELM_DATA_DIR", tempfile.mkdtemp(prefix="servelm-test-data-"))
# Without a GPU the Triton kernels (the triton attention backend) run under Triton's interpreter;
# it must be on before triton defines them (servelm imports them only when a model asks for them).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=7)


@pytest.fixture(scope="module")
def reference_model(tiny_dir):
    checkpoint = load_checkpoint(tiny_dir)
    return build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
