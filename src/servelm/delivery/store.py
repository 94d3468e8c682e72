"""A model directory being filled chunk by chunk: verified writes, a resume journal, waiting for bytes.

    DEST/
      model.safetensors, config.json, ...   full size from the start (sparse), filled in any order
      .servelm-pull/manifest.json            the version being pulled
      .servelm-pull/journal                  one chunk key per line, appended once its bytes are written
      servelm-manifest.json                  written last: its presence means "complete"

A chunk counts only after its sha256 matched (`write` verifies before writing), so a journal
line always names good bytes; a crash loses at most the chunks being written at that moment,
and a resumed pull fetches only what the journal does not list. A different manifest (another
version) in the way starts the directory over. Readers (the streaming loader, peers serving
what this node holds) wait on `wait_for` / ask `has`; all methods are thread-safe.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from servelm.delivery.manifest import MANIFEST_NAME, ChunkRef, Manifest, ManifestError

STATE_DIR = ".servelm-pull"
# How often written data is flushed to the disk (fdatasync): a power loss costs at most this
# much re-fetching; a process crash costs nothing (the page cache keeps what was written).
SYNC_INTERVAL_S = 5.0


class ChunkCorruptError(ValueError):
    """Bytes that do not hash to the manifest's sha256 (or have the wrong length)."""


class ChunkStore:
    """The local copy of one manifest's files; `open` resumes or starts it."""

    def __init__(self, directory: Path, manifest: Manifest, held: set[str]) -> None:
        self.directory = directory
        self.manifest = manifest
        self._chunks = {chunk.key: chunk for chunk in manifest.chunks()}
        self._held = held
        self._lock = threading.Condition()  # the held set: readers (has, wait_for, a peer server) take only this
        # Orders journal lines and syncs, taken before `_lock`. An fdatasync (seconds on a busy
        # disk) holds it, so writers wait for the sync, as they must, but readers do not.
        self._journal_lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._journal: int | None = None
        self._last_sync = time.monotonic()
        self._failure: BaseException | None = None  # why the pull gave up: waiters raise it
        self.resumed_chunks = len(held)  # held before this process started

    @classmethod
    def open(cls, directory: str | Path, manifest: Manifest) -> ChunkStore:
        """The store for `manifest` in `directory`: complete, resumed from its journal, or new."""
        base = Path(directory)
        base.mkdir(parents=True, exist_ok=True)
        state = base / STATE_DIR
        if cls.complete_manifest(base) == manifest:
            return cls(base, manifest, {chunk.key for chunk in manifest.chunks()})
        held: set[str] = set()
        recorded = state / "manifest.json"
        if recorded.is_file() and recorded.read_text() == manifest.to_json():
            known = {chunk.key for chunk in manifest.chunks()}
            held = {line for line in (state / "journal").read_text().splitlines() if line in known} if (
                state / "journal").is_file() else set()  # fmt: skip
        else:
            cls._remove_other_version(base, manifest)
            shutil.rmtree(state, ignore_errors=True)
            (base / MANIFEST_NAME).unlink(missing_ok=True)  # another version's completion mark
            state.mkdir()
            recorded.write_text(manifest.to_json())
        store = cls(base, manifest, held)
        store._open_files()
        return store

    @staticmethod
    def _remove_other_version(base: Path, manifest: Manifest) -> None:
        """Delete the files of the version in the way (complete or half-pulled) that `manifest`
        does not list: a loader globbing *.safetensors must not find the old version's extra
        shards. Files no manifest lists are the user's and stay."""
        keep = {entry.path for entry in manifest.files}
        for path in (base / STATE_DIR / "manifest.json", base / MANIFEST_NAME):
            try:
                other = Manifest.from_json(path.read_text(), str(path))
            except (OSError, ManifestError):
                continue
            for entry in other.files:
                if entry.path not in keep:
                    (base / entry.path).unlink(missing_ok=True)

    @staticmethod
    def complete_manifest(directory: str | Path) -> Manifest | None:
        """The manifest of a completely pulled directory, None while a pull is unfinished (or never began)."""
        base = Path(directory)
        path = base / MANIFEST_NAME
        if not path.is_file() or (base / STATE_DIR).exists():
            return None
        try:
            return Manifest.from_json(path.read_text(), str(path))
        except ManifestError:
            return None

    def _open_files(self) -> None:
        for entry in self.manifest.files:
            path = self.directory / entry.path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(fd).st_size != entry.size:
                os.ftruncate(fd, entry.size)  # full size now: safetensors headers can be read before the rest
            self._fds[entry.path] = fd
        self._journal = os.open(self.directory / STATE_DIR / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    # --- state -----------------------------------------------------------------------------

    def has(self, chunk: ChunkRef | str) -> bool:
        key = chunk if isinstance(chunk, str) else chunk.key
        with self._lock:
            return key in self._held

    def held_keys(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def missing(self) -> list[ChunkRef]:
        """Chunks not held yet, in manifest order."""
        with self._lock:
            return [chunk for chunk in self.manifest.chunks() if chunk.key not in self._held]

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._chunks[key].length for key in self._held)

    def is_complete(self) -> bool:
        with self._lock:
            return len(self._held) == len(self._chunks)

    def forget(self, chunk: ChunkRef) -> None:
        """Count a held chunk as missing again (its bytes failed a later check); the journal keeps
        its line, and a resumed pull that re-verifies finds it bad again."""
        with self._lock:
            self._held.discard(chunk.key)

    # --- writing ---------------------------------------------------------------------------

    def write(self, chunk: ChunkRef, data: bytes | memoryview) -> bool:
        """Verify `data` against the chunk's sha256, write it in place and journal it.

        ChunkCorruptError if it does not match (nothing is written). False when the chunk was
        already held (another connection won the race), True when this call stored it."""
        if not chunk.verify(data):
            raise ChunkCorruptError(f"chunk {chunk.key} ({len(data)} bytes) does not match its sha256 {chunk.sha256[:12]}")
        with self._lock:
            if chunk.key in self._held:
                return False
        fd = self._fds[chunk.file]
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], chunk.offset + written)
        with self._journal_lock:
            with self._lock:
                if chunk.key in self._held:
                    return False
            assert self._journal is not None
            os.write(self._journal, (chunk.key + "\n").encode())
            with self._lock:
                self._held.add(chunk.key)
                self._lock.notify_all()
            if time.monotonic() - self._last_sync > SYNC_INTERVAL_S:
                self._sync_locked()
        return True

    def _sync_locked(self) -> None:
        """Flush the data, then the journal; the caller holds `_journal_lock` (a line journaled
        while the data is flushed would name bytes the flush may have missed)."""
        for fd in self._fds.values():
            os.fdatasync(fd)
        if self._journal is not None:
            os.fdatasync(self._journal)
        self._last_sync = time.monotonic()

    def finish(self) -> None:
        """All chunks held: flush, write the completion mark, drop the pull's state. ManifestError if not."""
        with self._journal_lock:
            with self._lock:
                missing = len(self._chunks) - len(self._held)
            if missing:
                raise ManifestError(f"{self.directory}: {missing} chunk(s) still missing")
            self._sync_locked()
        self.close()
        target = self.directory / MANIFEST_NAME
        partial = target.with_suffix(".json.partial")
        partial.write_text(self.manifest.to_json())
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        # The mark first, the state second: a crash in between leaves a state whose journal
        # lists every chunk, which the next open resumes and finishes at once (the other way
        # round, the next pull found neither and fetched everything again).
        partial.replace(target)
        shutil.rmtree(self.directory / STATE_DIR)

    def close(self) -> None:
        with self._journal_lock, self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if self._journal is not None:
                os.close(self._journal)
                self._journal = None

    # --- reading ---------------------------------------------------------------------------

    def read(self, chunk: ChunkRef) -> bytes:
        """A held chunk's bytes (for a peer); KeyError if it is not held."""
        if not self.has(chunk):
            raise KeyError(f"chunk {chunk.key} is not held here")
        with (self.directory / chunk.file).open("rb") as f:
            f.seek(chunk.offset)
            return f.read(chunk.length)

    def fail(self, error: BaseException) -> None:
        """The pull filling this store gave up: every waiter (now or later) raises `error`."""
        with self._lock:
            self._failure = error
            self._lock.notify_all()

    def wait_for(self, chunks: Iterable[ChunkRef], timeout_s: float | None = None) -> bool:
        """Block until every chunk is held; False on timeout; raises the pull's error if it failed."""
        keys = [chunk.key for chunk in chunks]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while not all(key in self._held for key in keys):
                if self._failure is not None:
                    raise self._failure
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._lock.wait(remaining if remaining is not None else 1.0)
        return True

    def wait_for_bytes(self, path: str, start: int, end: int, timeout_s: float | None = None) -> bool:
        return self.wait_for(self.manifest.chunks_covering(path, start, end), timeout_s)
