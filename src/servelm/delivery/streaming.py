"""A remote `--model` loads while it downloads: each tensor is read as soon as its bytes arrive.

    remote = start_pull("http://origin/models/llama/", download_dir)   # threads start fetching
    remote.wait_for_metadata()             # config, tokenizer, index and safetensors headers
    load_checkpoint(remote.directory, before_read=remote.before_read)  # per tensor: wait, then read
    remote.finish()                        # the rest (if any) arrived, the directory is complete

The fetch order is the load order: small files first (config.json, tokenizer, the shard
index), then each safetensors file's header, then the tensors as the model consumes them
(embeddings, head and final norm, then layer by layer), whatever their order in the files. A
tensor the loader asks for before its turn jumps the queue. A GGUF checkpoint is not streamed
(its reader maps the whole file): it loads once the pull is complete.

A directory already complete for the origin's manifest (an earlier pull) is used as it is; an
interrupted one resumes from its journal, and what it held is verified again first (a crash or
power loss may have left a journaled chunk unwritten): the `verify` phase.
"""

from __future__ import annotations

import json
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from servelm.delivery.manifest import ChunkRef, Manifest
from servelm.delivery.pull import Puller, PullStats
from servelm.delivery.source import ChunkSource
from servelm.delivery.store import ChunkStore

SAFETENSORS_SUFFIX = ".safetensors"
_HEADER_LENGTH_BYTES = 8  # a safetensors file starts with its JSON header's length, u64 little-endian
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class RemoteModel:
    """A model being pulled into `store.directory` by `puller`, readable tensor by tensor."""

    spec: str
    store: ChunkStore
    puller: Puller
    started_at: float  # wall clock, for the fetch phase
    verify_seconds: float = 0.0  # re-hashing what an interrupted pull held
    # (file, tensor) -> its bytes; filled by wait_for_metadata before the loader is handed before_read,
    # and only read after that (no lock needed).
    _ranges: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    @property
    def directory(self) -> Path:
        return self.store.directory

    @property
    def manifest(self) -> Manifest:
        return self.store.manifest

    def streamable(self) -> bool:
        """Whether the weights are safetensors (read per tensor), not a GGUF file (read whole)."""
        return any(entry.path.endswith(SAFETENSORS_SUFFIX) for entry in self.manifest.files)

    def wait_for_metadata(self) -> None:
        """Every file but the weights, and each safetensors header; then fetch in load order."""
        small = [chunk for entry in self.manifest.files if not _is_weights(entry.path) for chunk in entry.chunks]
        self.puller.prioritize(small)
        self.store.wait_for(small)
        for entry in self.manifest.files:
            if entry.path.endswith(SAFETENSORS_SUFFIX):
                self._read_header(entry.path)
        self.puller.prioritize(self._load_order())

    def _read_header(self, path: str) -> None:
        self._wait_bytes(path, 0, _HEADER_LENGTH_BYTES)
        file = self.directory / path
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(_HEADER_LENGTH_BYTES))
            self._wait_bytes(path, _HEADER_LENGTH_BYTES, _HEADER_LENGTH_BYTES + length)
            f.seek(_HEADER_LENGTH_BYTES)
            header = json.loads(f.read(length))
        base = _HEADER_LENGTH_BYTES + length
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                self._ranges[(path, name)] = (base + start, base + end)

    def _wait_bytes(self, path: str, start: int, end: int) -> None:
        chunks = self.manifest.chunks_covering(path, start, end)
        self.puller.prioritize(chunks)
        self.store.wait_for(chunks)

    def _load_order(self) -> list[ChunkRef]:
        """Every weights chunk in the order the model reads its tensors: unlayered ones first
        (embeddings, final norm, head), then layer by layer; within a layer, by file offset."""
        ordered = sorted(self._ranges.items(), key=lambda item: (_layer_of(item[0][1]), item[0][0], item[1][0]))
        chunks: dict[str, ChunkRef] = {}
        for (path, _), (start, end) in ordered:
            for chunk in self.manifest.chunks_covering(path, start, end):
                chunks.setdefault(chunk.key, chunk)
        return list(chunks.values())

    def before_read(self, file: Path, tensor: str) -> None:
        """The loader's hook (after wait_for_metadata): block until `tensor`'s bytes in `file` are held,
        asking for them first."""
        path = file.relative_to(self.directory).as_posix()
        self._wait_bytes(path, *self._ranges[(path, tensor)])

    def finish(self) -> PullStats:
        """Wait for the whole pull (the bytes no tensor needed: other files, padding) and return its stats."""
        try:
            return self.puller.wait()
        finally:
            self.puller.source.close()


def _is_weights(path: str) -> bool:
    return path.endswith(SAFETENSORS_SUFFIX) or path.endswith(".gguf")


def _layer_of(tensor: str) -> int:
    match = _LAYER.search(tensor)
    return int(match.group(1)) if match else -1


def remote_model_name(spec: str) -> str | None:
    """The name a remote --model is served under: the last part of its URL path (http, s3), or
    HOST:PORT for a peer (the server asks the peer for its name instead); None for a local path."""
    if "://" not in spec:
        return None
    return spec.split("://", 1)[1].strip("/").rsplit("/", 1)[-1] or spec


def download_directory(spec: str, manifest: Manifest, download_dir: Path) -> Path:
    """Where a pull of `spec` lands: named after its source and version, so two versions (or two
    origins' copies) never share a directory, and a restart finds its earlier pull."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", spec.split("://", 1)[-1].strip("/")).strip("-")[-60:] or "model"
    return download_dir / f"{name}-{manifest.digest[:12]}"


def verify_held(store: ChunkStore) -> int:
    """Re-hash every chunk an interrupted pull's journal lists; forget those that do not match
    (they are fetched again). Returns how many were dropped."""
    dropped = 0
    for chunk in store.manifest.chunks():
        if store.has(chunk):
            with (store.directory / chunk.file).open("rb") as f:
                f.seek(chunk.offset)
                if not chunk.verify(f.read(chunk.length)):
                    store.forget(chunk)
                    dropped += 1
    return dropped


def start_pull(source: ChunkSource, spec: str, download_dir: Path, connections: int) -> RemoteModel:
    """Open (or resume) the local copy of `source`'s model and start fetching it."""
    manifest = source.fetch_manifest()
    directory = download_directory(spec, manifest, download_dir)
    store = ChunkStore.open(directory, manifest)
    verify_seconds = 0.0
    if store.resumed_chunks and not store.is_complete():  # a complete directory was fsynced before it was marked
        started = time.perf_counter()
        verify_held(store)
        verify_seconds = time.perf_counter() - started
    puller = Puller(source, store, connections=connections).start()
    return RemoteModel(spec, store, puller, time.time(), verify_seconds)
