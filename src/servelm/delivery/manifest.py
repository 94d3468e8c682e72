"""What a model version is made of: every file, cut into fixed-size chunks, each with its sha256.

    servelm-manifest.json
      {"format": 1, "chunk_bytes": 16777216,
       "files": [{"path": "model-00001-of-00002.safetensors", "size": 123,
                  "chunks": ["<sha256 of bytes 0..chunk_bytes>", ...]}, ...]}

Chunks are the unit of everything in delivery: a ranged read from an origin, a verification
(on arrival, before the bytes count), a line of the resume journal, a piece exchanged between
nodes. The manifest's own sha256 (`Manifest.digest`) names the version: a resume, a peer or a
running replica holding another digest holds another model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "servelm-manifest.json"
FORMAT = 1
# Big enough that a request's overhead (a round trip, a header, a journal line) is a small
# share of its time at 25 GB/s; small enough that a 700 GB model has ~44k pieces to spread
# over a cluster and a corrupted one costs 16 MiB to fetch again.
DEFAULT_CHUNK_BYTES = 16 << 20
# Files that are never part of a model: the manifest itself and a pull's own bookkeeping.
IGNORED_NAMES = frozenset({MANIFEST_NAME})
IGNORED_DIRS = frozenset({".servelm-pull", ".git", "__pycache__"})
# What makes a directory a model's: at least one file of weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """A manifest that cannot be read, or files that do not match one."""


@dataclass(frozen=True)
class ChunkRef:
    """Bytes offset..offset+length of one file, and what they must hash to."""

    file: str  # path relative to the model directory, '/'-separated
    index: int  # the chunk's number within its file
    offset: int
    length: int
    sha256: str

    @property
    def key(self) -> str:
        """Unique within a manifest: the journal's and the peers' name for the chunk."""
        return f"{self.file}#{self.index}"

    @property
    def end(self) -> int:
        return self.offset + self.length

    def verify(self, data: bytes | memoryview) -> bool:
        return len(data) == self.length and hashlib.sha256(data).hexdigest() == self.sha256


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True)
class Manifest:
    chunk_bytes: int
    files: tuple[FileEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def chunks(self) -> list[ChunkRef]:
        """Every chunk, file by file (in manifest order), each file front to back."""
        return [chunk for entry in self.files for chunk in entry.chunks]

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(f"no file {path!r} in the manifest")

    def chunks_covering(self, path: str, start: int, end: int) -> list[ChunkRef]:
        """The chunks of `path` that hold any of bytes start..end (end exclusive)."""
        entry = self.file(path)
        if end <= start:
            return []
        first, last = start // self.chunk_bytes, (end - 1) // self.chunk_bytes
        return list(entry.chunks[first : last + 1])

    def to_json(self) -> str:
        files = [{"path": e.path, "size": e.size, "chunks": [c.sha256 for c in e.chunks]} for e in self.files]
        return json.dumps({"format": FORMAT, "chunk_bytes": self.chunk_bytes, "files": files}, indent=1) + "\n"

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON: the model version's name."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest") -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ManifestError(f"{source}: manifest format {raw.get('format')!r}, this servelm reads {FORMAT}")
            chunk_bytes = int(raw["chunk_bytes"])
            files = tuple(_file_entry(f["path"], int(f["size"]), list(f["chunks"]), chunk_bytes) for f in raw["files"])
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError is a ValueError
            raise ManifestError(f"{source} is not a servelm manifest: {exc!r}") from exc
        paths = [entry.path for entry in files]
        if len(set(paths)) != len(paths):
            raise ManifestError(f"{source}: a file is listed twice")
        return cls(chunk_bytes, files)


def _file_entry(path: str, size: int, hashes: list[str], chunk_bytes: int) -> FileEntry:
    # A manifest comes from elsewhere: its paths must stay inside the directory and clear of the
    # pull's own files (.servelm-pull/journal, the completion mark) and of .git (hooks run code).
    parts = path.split("/")
    if (chunk_bytes <= 0 or size < 0 or any(part in ("", ".", "..") for part in parts)
            or any(part in IGNORED_DIRS for part in parts) or parts[-1] in IGNORED_NAMES):  # fmt: skip
        raise ManifestError(f"bad manifest entry {path!r} (size {size}, chunk_bytes {chunk_bytes})")
    if not all(isinstance(sha, str) and _SHA256.fullmatch(sha) for sha in hashes):
        raise ManifestError(f"manifest entry {path!r}: chunk hashes must be sha256 hex digests")
    expected = max(1, -(-size // chunk_bytes))  # an empty file still has one (empty) chunk
    if len(hashes) != expected:
        raise ManifestError(f"manifest entry {path!r}: {len(hashes)} chunk hashes for {size} bytes, expected {expected}")
    chunks = tuple(
        ChunkRef(path, i, i * chunk_bytes, min(chunk_bytes, size - i * chunk_bytes), sha)
        for i, sha in enumerate(hashes)
    )
    return FileEntry(path, size, chunks)


def model_files(directory: Path) -> Iterator[Path]:
    """The files a manifest of `directory` covers, sorted; bookkeeping and VCS files left out."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS)
        for name in sorted(files):
            if name not in IGNORED_NAMES:
                yield Path(root) / name


def resolve_model_file(root: Path, path: str) -> Path | None:
    """The file `path` (relative, '/'-separated) under `root`, None for anything a server must not
    hand out: an absolute or escaping path, a pull's bookkeeping, a directory, a missing file."""
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts) or parts[0] in IGNORED_DIRS:
        return None
    resolved = root.joinpath(*parts)
    return resolved if resolved.is_file() else None


def build_manifest(
    directory: str | Path,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
    only: list[str] | None = None,
) -> Manifest:
    """Hash every file of `directory` (or the relative paths `only`) chunk by chunk, in threads
    (hashlib releases the GIL)."""
    base = Path(directory)
    if not base.is_dir():
        raise FileNotFoundError(f"{base} is not a directory")
    paths = list(model_files(base)) if only is None else [base / name for name in only]

    def hashes(path: Path) -> list[str]:
        with path.open("rb") as f:
            out = [hashlib.sha256(block).hexdigest() for block in iter(lambda: f.read(chunk_bytes), b"")]
        return out or [hashlib.sha256(b"").hexdigest()]

    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
        all_hashes = list(pool.map(hashes, paths))
    files = tuple(
        _file_entry(path.relative_to(base).as_posix(), path.stat().st_size, found, chunk_bytes)
        for path, found in zip(paths, all_hashes)
    )
    return Manifest(chunk_bytes, files)


def require_weights(manifest: Manifest, where: str) -> None:
    """ManifestError unless `manifest` lists a weights file: a manifest of a wrong or empty
    directory would otherwise publish, and pull, a "model" of no bytes."""
    if not any(entry.path.endswith(WEIGHT_SUFFIXES) for entry in manifest.files):
        found = ", ".join(entry.path for entry in manifest.files[:5]) or "no files"
        raise ManifestError(f"{where} holds no model weights (expected at least one {' / '.join(WEIGHT_SUFFIXES)} "
                            f"file, next to config.json; found {found})")  # fmt: skip


def write_manifest(directory: str | Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Path:
    """`servelm manifest DIR`: write DIR/servelm-manifest.json (atomically) and return its path;
    ManifestError (nothing written) when DIR holds no model weights."""
    manifest = build_manifest(directory, chunk_bytes)
    require_weights(manifest, str(directory))
    target = Path(directory) / MANIFEST_NAME
    partial = target.with_suffix(".json.partial")
    partial.write_text(manifest.to_json())
    partial.replace(target)
    return target


def read_manifest(directory: str | Path) -> Manifest:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{directory} has no {MANIFEST_NAME} (write one with `servelm manifest {directory}`)")
    return Manifest.from_json(path.read_text(), str(path))
