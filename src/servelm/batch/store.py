"""The batch state that survives a crash: files, batches and every input line, in one SQLite database.

A line's result is written in the same transaction that marks it done and counts it, so a
restart finds each line either done (its result kept, never run again) or pending (run again,
as if never started): no line is lost, none is counted or written twice. The output and error
files are built from these rows in line order once the batch ends (runner.py).

WAL journal, synchronous=NORMAL: a commit survives the process dying (kill -9), which is what a
server restart needs; a power cut may lose the last commits, which then run again, never twice.
One connection, behind a lock: the service calls it from a worker thread, off the event loop.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from servelm.batch.records import (
    ACTIVE_STATUSES,
    CANCELLING,
    IN_PROGRESS,
    LINE_ERROR,
    LINE_OUTPUT,
    LINE_PENDING,
    VALIDATING,
    BatchError,
    BatchRecord,
    FileRecord,
    PendingLine,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, window_s REAL NOT NULL, created_at INTEGER NOT NULL,
    status TEXT NOT NULL, metadata TEXT, output_file_id TEXT, error_file_id TEXT, errors TEXT NOT NULL,
    total INTEGER NOT NULL, completed INTEGER NOT NULL, failed INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, ending TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, byte_offset INTEGER NOT NULL,
    length INTEGER NOT NULL, state INTEGER NOT NULL, result TEXT, PRIMARY KEY (batch_id, line_no));
CREATE UNIQUE INDEX IF NOT EXISTS lines_custom_id ON lines (batch_id, custom_id);
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, state, line_no);
"""
_BATCH_COLUMNS = (
    "id", "tenant", "endpoint", "input_file_id", "completion_window", "window_s", "created_at", "status",
    "metadata", "output_file_id", "error_file_id", "errors", "total", "completed", "failed", "in_progress_at",
    "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "ending",
    "input_tokens", "cached_tokens", "output_tokens",
)  # fmt: skip
_FILE_COLUMNS = ("id", "tenant", "purpose", "filename", "bytes", "created_at")
# Kept by the line updates (and a cancel) in their own transactions, never by save_batch.
_LINE_KEPT = ("id", "total", "completed", "failed", "cancelling_at", "input_tokens", "cached_tokens", "output_tokens")
SCHEMA_VERSION = 1  # PRAGMA user_version: what a later release migrates from


class DuplicateCustomId(ValueError):
    """Two lines of one batch share a `custom_id`; `line_no` is the second."""

    def __init__(self, custom_id: str, line_no: int) -> None:
        super().__init__(f"custom_id {custom_id!r} appears more than once (again on line {line_no})")
        self.custom_id, self.line_no = custom_id, line_no


class BatchStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise RuntimeError(f"{path} was written by another servelm version (schema {version}, this one "
                                   f"reads {SCHEMA_VERSION}): give this server another --data-dir")  # fmt: skip
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # Files.
    def add_file(self, record: FileRecord) -> None:
        with self._lock:
            self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                             tuple(getattr(record, c) for c in _FILE_COLUMNS))  # fmt: skip

    def get_file(self, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRecord(*row) if row else None

    def list_files(self, tenant: str, purpose: str | None, limit: int, after: str | None, newest_first: bool) -> list[FileRecord]:
        """A tenant's files by creation (ties by id), `after` the file of that id (a cursor)."""
        order = "DESC" if newest_first else "ASC"
        clauses, params = ["tenant = ?"], [tenant]
        if purpose is not None:
            clauses.append("purpose = ?")
            params.append(purpose)
        if after is not None:
            cursor = self.get_file(after)
            if cursor is not None:
                op = "<" if newest_first else ">"
                clauses.append(f"(created_at, id) {op} (?, ?)")
                params += [cursor.created_at, cursor.id]  # type: ignore[list-item]
        sql = f"SELECT * FROM files WHERE {' AND '.join(clauses)} ORDER BY created_at {order}, id {order} LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*params, limit)).fetchall()
        return [FileRecord(*row) for row in rows]

    def count_files(self, tenant: str) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM files WHERE tenant = ?", (tenant,)).fetchone()[0])

    def delete_file(self, file_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))

    # Batches.
    def add_batch(self, batch: BatchRecord) -> None:
        with self._lock:
            self._db.execute(f"INSERT INTO batches VALUES ({', '.join('?' * len(_BATCH_COLUMNS))})", _batch_row(batch))

    def save_batch(self, batch: BatchRecord) -> None:
        """Its status, times, files and errors. Not the counts (the lines' own: replace_lines and finish_line keep
        them) nor when it was cancelled (mark_cancelling's, which a runner's copy may predate)."""
        columns = [c for c in _BATCH_COLUMNS if c not in _LINE_KEPT]
        values = dict(zip(_BATCH_COLUMNS, _batch_row(batch), strict=True))
        with self._lock:
            self._db.execute(f"UPDATE batches SET {', '.join(f'{c} = ?' for c in columns)} WHERE id = ?",
                             (*(values[c] for c in columns), batch.id))  # fmt: skip

    def mark_cancelling(self, batch_id: str, at: int) -> bool:
        """Cancel a batch that has not begun to finalize; False when it had (or ended)."""
        with self._lock:
            return self._db.execute(
                "UPDATE batches SET status = ?, cancelling_at = ? WHERE id = ? AND status IN (?, ?)",
                (CANCELLING, at, batch_id, VALIDATING, IN_PROGRESS),
            ).rowcount == 1

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return _batch_of(row) if row else None

    def list_batches(self, tenant: str, limit: int, after: str | None) -> list[BatchRecord]:
        """A tenant's batches, newest first, `after` the batch of that id (a cursor)."""
        clauses, params = ["tenant = ?"], [tenant]
        if after is not None and (cursor := self.get_batch(after)) is not None:
            clauses.append("(created_at, id) < (?, ?)")
            params += [cursor.created_at, cursor.id]  # type: ignore[list-item]
        sql = f"SELECT * FROM batches WHERE {' AND '.join(clauses)} ORDER BY created_at DESC, id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*params, limit)).fetchall()
        return [_batch_of(row) for row in rows]

    def active_batches(self) -> list[BatchRecord]:
        """The batches a restart resumes, oldest first."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY created_at, id",
                                    ACTIVE_STATUSES).fetchall()  # fmt: skip
        return [_batch_of(row) for row in rows]

    def count_active_batches(self, tenant: str) -> int:
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        with self._lock:
            row = self._db.execute(f"SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN ({marks})",
                                   (tenant, *ACTIVE_STATUSES)).fetchone()  # fmt: skip
        return int(row[0])

    # Lines.
    def replace_lines(self, batch_id: str, lines: Iterable[tuple[int, str | None, int, int, str | None]]) -> int:
        """A batch's lines, (line_no, custom_id, offset, length, error result or None), in one
        transaction that first drops any a crashed validation left; a line with an error result is
        already done (in the error file). Returns how many; DuplicateCustomId (nothing kept)."""
        total = failed = 0
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                for line_no, custom_id, offset, length, error_result in lines:
                    state = LINE_PENDING if error_result is None else LINE_ERROR
                    try:
                        self._db.execute("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?, ?)",
                                         (batch_id, line_no, custom_id, offset, length, state, error_result))  # fmt: skip
                    except sqlite3.IntegrityError:
                        raise DuplicateCustomId(custom_id or "", line_no) from None
                    total += 1
                    failed += error_result is not None
                self._db.execute("UPDATE batches SET total = ?, completed = 0, failed = ? WHERE id = ?",
                                 (total, failed, batch_id))  # fmt: skip
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return total

    def pending_lines(self, batch_id: str, after_line: int, limit: int) -> list[PendingLine]:
        with self._lock:
            rows = self._db.execute(
                "SELECT line_no, custom_id, byte_offset, length FROM lines "
                "WHERE batch_id = ? AND state = ? AND line_no > ? ORDER BY line_no LIMIT ?",
                (batch_id, LINE_PENDING, after_line, limit),
            ).fetchall()
        return [PendingLine(*row) for row in rows]

    def finish_line(self, batch_id: str, line_no: int, in_output: bool, result: str,
                    usage: tuple[int, int, int] = (0, 0, 0)) -> bool:  # fmt: skip
        """Keep a line's result and count it and its `usage` (input, cached, output tokens), once:
        False when it was done already."""
        state, counter = (LINE_OUTPUT, "completed") if in_output else (LINE_ERROR, "failed")
        with self._lock:
            self._db.execute("BEGIN")
            try:
                done = self._db.execute("UPDATE lines SET state = ?, result = ? WHERE batch_id = ? AND line_no = ? AND state = ?",
                                        (state, result, batch_id, line_no, LINE_PENDING)).rowcount == 1  # fmt: skip
                if done:
                    self._db.execute(f"UPDATE batches SET {counter} = {counter} + 1, input_tokens = input_tokens + ?, "
                                     "cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                                     (*usage, batch_id))  # fmt: skip
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return done

    def results(self, batch_id: str, state: int, page: int = 512) -> Iterator[str]:
        """The results of a batch's lines in `state`, in line order, a page at a time (bounded memory)."""
        after = 0
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT line_no, result FROM lines WHERE batch_id = ? AND state = ? AND line_no > ? ORDER BY line_no LIMIT ?",
                    (batch_id, state, after, page),
                ).fetchall()
            if not rows:
                return
            for _, result in rows:
                yield result
            after = rows[-1][0]

    def counts(self, batch_id: str) -> tuple[int, int, int]:
        """(total, completed, failed): what replace_lines and finish_line counted, with each line's change."""
        with self._lock:
            row = self._db.execute("SELECT total, completed, failed FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)

    def drop_lines(self, batch_id: str) -> None:
        """A finished batch's line rows (its output and error files hold their results now)."""
        with self._lock:
            self._db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))


def _batch_row(batch: BatchRecord) -> tuple[Any, ...]:
    values = {c: getattr(batch, c, None) for c in _BATCH_COLUMNS}
    values["metadata"] = json.dumps(batch.metadata) if batch.metadata is not None else None
    values["errors"] = batch.errors_json()
    return tuple(values[c] for c in _BATCH_COLUMNS)


def _batch_of(row: tuple[Any, ...]) -> BatchRecord:
    values = dict(zip(_BATCH_COLUMNS, row, strict=True))
    values["metadata"] = json.loads(values["metadata"]) if values["metadata"] is not None else None
    values["errors"] = [BatchError(**e) for e in json.loads(values["errors"])]
    return BatchRecord(**values)
