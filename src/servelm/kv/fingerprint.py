"""The model fingerprint that namespaces stored KV: blocks saved by one model are never read by
another (other weights, KV dtype, block geometry or layout would read as garbage, not as a miss).

    fingerprint = sha256( architecture config (sorted JSON) | weights identity | KV layout )[:32 hex]

The weights identity is every weight file's name and size and a digest of its first and last
MiB: enough to tell checkpoints apart (a fine-tune changes the bytes everywhere) without reading
gigabytes at startup. Replicas loading the same files get the same fingerprint, so they share
a disk tier; a restarted replica finds its own blocks again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_SAMPLE_BYTES = 2**20


def weights_identity(source: str | Path) -> str:
    """Names, sizes and head/tail digests of the weight files at `source` (a file or a directory)."""
    path = Path(source)
    if not path.exists():  # weights built in memory (random, for a benchmark): the label names them
        return hashlib.sha256(str(source).encode()).hexdigest()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        if file.suffix not in (".safetensors", ".gguf", ".bin", ".pt", ".json"):
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(_SAMPLE_BYTES))
            handle.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def kv_fingerprint(arch: Mapping[str, Any], weights: str, kv_layout: Mapping[str, Any]) -> str:
    """32 hex characters naming (architecture, weights, KV layout: dtype, block size, tensors)."""
    text = json.dumps({"arch": arch, "weights": weights, "kv": kv_layout}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
