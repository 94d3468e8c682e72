"""The bytes of uploaded and written files, one file each under DATA_DIR/files/ (their records
are in the store). A file is written to a temporary name, flushed to disk and renamed, so a crash
leaves either the whole file or none."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if "/" in file_id or file_id.startswith("."):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def partial_path(self, file_id: str) -> Path:
        """Where an upload or a written file goes until it is whole."""
        return self.root / f".{file_id}.partial"

    def commit(self, file_id: str) -> None:
        """The partial file becomes the file, durably."""
        partial = self.partial_path(file_id)
        with partial.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, self.path(file_id))

    def write_lines(self, file_id: str, lines: Iterable[str]) -> int:
        """Write `lines` (each ended by a newline) as the file; returns its size in bytes."""
        size = 0
        with self.partial_path(file_id).open("wb") as f:
            for line in lines:
                data = (line + "\n").encode()
                f.write(data)
                size += len(data)
        self.commit(file_id)
        return size

    def delete(self, file_id: str) -> None:
        for path in (self.path(file_id), self.partial_path(file_id)):
            path.unlink(missing_ok=True)

    def read_at(self, file_id: str, offset: int, length: int) -> bytes:
        with self.path(file_id).open("rb") as f:
            f.seek(offset)
            return f.read(length)
