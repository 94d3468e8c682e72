"""Real servers for the HTTP tests: `servelm serve` subprocesses on a tiny random Llama.

`server` is shared by every test module here (session scope) and kept in a state any test
may rely on: nothing left running when a test ends. Tests that need other flags (API key,
a tiny waiting queue, SIGTERM) start their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers_http import KEY
from servelm.server.launcher import launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

# 4096 blocks x 16 tokens: room for the 200-stream load test with margin.
SHARED_SERVER_ARGS = [
    "--num-blocks", "4096", "--block-size", "16", "--max-num-seqs", "256",
    "--max-num-batched-tokens", "2048", "--num-threads", "1", "--max-waiting-requests", "512",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-server") / "model", seed=3)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path):
    process = launch_server(tiny_model_dir, SHARED_SERVER_ARGS)
    yield process
    code = process.stop()
    assert code == 0, f"shared server exited with {code}:\n{process.log_tail()}"


@pytest.fixture(scope="session")
def restricted(tiny_model_dir):
    """Key from the environment (the flag is the same field), 3 waiting requests at most, 2 running."""
    args = ["--num-blocks", "512", "--max-num-seqs", "2", "--max-waiting-requests", "3", "--num-threads", "1"]
    process = launch_server(tiny_model_dir, args, env={"SERVELM_API_KEY": KEY})
    yield process
    assert process.stop() == 0, process.log_tail()
