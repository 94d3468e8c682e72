"""A real `servelm serve` on a tiny random Llama, shared by the diagnose tests.

The model's context is 8192 tokens (the tiny default is 1024) so a window can carry prompts
of several thousand tokens next to short ones, the traffic that makes the scheduler the cause.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.server.launcher import ServerProcess, launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

MAX_MODEL_LEN = 8192
SERVER_ARGS = ["--num-blocks", "2048", "--block-size", "16", "--num-threads", "1", "--max-num-batched-tokens", "2048"]


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-diagnose") / "model", seed=11, max_position_embeddings=MAX_MODEL_LEN
    )


@pytest.fixture(scope="session")
def server(long_context_model: Path):
    process: ServerProcess = launch_server(long_context_model, SERVER_ARGS)
    yield process
    code = process.stop()
    assert code == 0, f"diagnose test server exited with {code}:\n{process.log_tail()}"
