"""A small model directory for the delivery tests: a file in a subdirectory with odd characters
in its name, an empty file, files of several chunks, and its manifest."""

from __future__ import annotations

import random
from pathlib import Path

from servelm.delivery.manifest import write_manifest

CHUNK_BYTES = 64 << 10
FILES = {  # path: size; chunk counts 6, 1 (shorter than a chunk), 1 (empty), 3 (exact multiple)
    "model-00001-of-00002.safetensors": 5 * CHUNK_BYTES + 1234,
    "config.json": 321,
    "empty.txt": 0,
    "sub dir/we#ird %+name?.bin": 3 * CHUNK_BYTES,
}


def write_model_dir(directory: Path, files: dict[str, int] = FILES, seed: int = 0) -> Path:
    rng = random.Random(seed)
    for name, size in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    write_manifest(directory, CHUNK_BYTES)
    return directory


def same_files(a: Path, b: Path, files: dict[str, int] = FILES) -> bool:
    return all((a / name).read_bytes() == (b / name).read_bytes() for name in files)
