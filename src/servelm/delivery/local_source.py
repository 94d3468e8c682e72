"""Chunks from a directory on this machine or a mounted one (NFS, a shared volume): a pread each.

The directory must hold its servelm-manifest.json (`servelm manifest DIR`). One file
descriptor per file, opened on first use and shared: os.pread takes its own offset, so any
number of puller threads read through one descriptor at once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from servelm.delivery.manifest import ChunkRef, Manifest, read_manifest
from servelm.delivery.source import FetchError


class LocalSource:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.description = str(self.directory)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fetch_manifest(self) -> Manifest:
        return read_manifest(self.directory)  # ManifestError with the hint when there is none

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(self.directory / path, os.O_RDONLY)
            return fd

    def read(self, chunk: ChunkRef) -> bytes:
        where = f"chunk {chunk.key} (bytes {chunk.offset}-{chunk.end - 1}) from {self.directory / chunk.file}"
        try:
            fd = self._fd(chunk.file)
            data = os.pread(fd, chunk.length, chunk.offset)
            while 0 < len(data) < chunk.length:  # a network filesystem may return less than asked
                more = os.pread(fd, chunk.length - len(data), chunk.offset + len(data))
                if not more:
                    break
                data += more
        except FileNotFoundError as exc:
            raise FetchError(f"{where}: the file is missing at the origin") from exc
        except OSError as exc:
            raise FetchError(f"{where}: {exc}") from exc
        if len(data) != chunk.length:  # the file is shorter than the manifest says
            raise FetchError(f"{where}: {len(data)} bytes, expected {chunk.length}")
        return data

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
