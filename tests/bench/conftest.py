"""Fixtures for the bench tests: the real tokenizer of the tiny model, and a real `servelm serve`
on that model (its own process, real HTTP on 127.0.0.1), shared by the whole bench suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.bench.tokens import TokenSource, load_token_source
from servelm.server.launcher import ServerProcess, launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

# One engine thread: the machine is shared. 4096 blocks of 16 tokens hold every test's prompts.
SERVER_ARGS = ["--num-blocks", "4096", "--block-size", "16", "--max-num-seqs", "64",
               "--max-num-batched-tokens", "2048", "--num-threads", "1"]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bench") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_model_8k_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with SmolLM2's 8192-token context: scenarios that send real-length documents."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bench-8k") / "model", seed=0,
                                 max_position_embeddings=8192)  # fmt: skip


@pytest.fixture(scope="session")
def tokens(tiny_model_dir: Path) -> TokenSource:
    """The tiny model's tokenizer: SmolLM2's real 49152-token BPE."""
    return load_token_source(tiny_model_dir)


@pytest.fixture(scope="session")
def bench_server(tiny_model_dir: Path) -> ServerProcess:
    process = launch_server(tiny_model_dir, SERVER_ARGS)
    yield process
    code = process.stop()
    assert code == 0, f"server exited with {code}:\n{process.log_tail()}"
