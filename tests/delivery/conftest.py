"""The delivery tests' fixtures: the small model directory (delivery_helpers) and a
RangeFileServer origin serving it, with faults the test may inject."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from delivery_helpers import write_model_dir

from servelm.delivery.file_server import DirectoryFiles, Faults, RangeFileServer


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "origin")


@pytest.fixture
def faults() -> Faults:
    return Faults()


@pytest.fixture
def origin(model_dir: Path, faults: Faults) -> Iterator[RangeFileServer]:
    server = RangeFileServer(DirectoryFiles(model_dir), faults=faults).start()
    yield server
    server.stop()
