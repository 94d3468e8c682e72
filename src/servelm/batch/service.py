"""The Files and Batch APIs' operations, for one tenant at a time; the HTTP routes (routes.py) only
parse and render. Everything lives under `data_dir`: batch.sqlite3 (store.py) and files/.

A tenant sees only its own files and batches (another's id is a 404, as if it did not exist), and
holds at most `max_files_per_tenant` files and `max_batches_per_tenant` unfinished batches.
Batches left unfinished by the previous process are resumed by `start()`.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from servelm.batch.arguments import BatchOptions
from servelm.batch.executor import AppExecutor
from servelm.batch.files import FileStore, new_file_id
from servelm.batch.pacing import BatchPacer
from servelm.batch.records import ACTIVE_STATUSES, BATCH_ENDPOINTS, BatchRecord, FileRecord
from servelm.batch.runner import BatchRunner, LineSlots, RunnerParts
from servelm.batch.store import BatchStore
from servelm.batch.upload import UploadError, UploadTooLarge, receive_upload

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_WINDOW_S = 24 * 3600.0
_WINDOW = re.compile(r"^(\d+)([smh])$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class PacingState:
    """What the batch runner is doing now, for the metrics."""

    in_flight: int = 0
    allowed: int = 0
    finished_output: int = 0
    finished_error: int = 0


class BatchRequestError(Exception):
    """A request the Files or Batch API refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def completion_window_seconds(window: str) -> float:
    """"24h" (OpenAI's only value), or a shorter window in s, m or h: ValueError otherwise."""
    match = _WINDOW.match(window)
    seconds = int(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(f"completion_window must be '24h' (or a shorter window such as '30m'), got {window!r}")
    return seconds


class DataDirInUse(RuntimeError):
    """Another process runs batches from this data directory."""


def open_batch_service(options: BatchOptions, front: str, port: int) -> BatchService | str:
    """The service, or why there is none (its routes then answer 503 saying so; the front serves on)."""
    try:
        return BatchService(options.data_dir_for(front, port), options)
    except (DataDirInUse, OSError) as exc:
        logger.error("batch jobs are off: %s", exc)
        return f"batch jobs are off on this server: {exc}"


class BatchService:
    def __init__(self, data_dir: Path, limits: BatchOptions) -> None:
        """Takes the data directory for this process (DataDirInUse if another holds it: two
        servers resuming the same batches would run every line twice)."""
        self.data_dir = data_dir
        self.limits = limits
        data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = (data_dir / "lock").open("a+")
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise DataDirInUse(f"{data_dir} is in use by another servelm process: give each server its own --data-dir") from None
        self.store = BatchStore(data_dir / "batch.sqlite3")
        self.files = FileStore(data_dir / "files")
        self._db_thread = ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        self._runners: dict[str, tuple[BatchRunner, asyncio.Task[None]]] = {}
        self._parts: RunnerParts | None = None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the store's thread: SQLite and file writes never block the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._db_thread, functools.partial(fn, *args))

    async def start(self, executor: AppExecutor, pacer: BatchPacer, caller_for: Callable[[str], object]) -> None:
        """Run batches from now on (the engine serves), the unfinished ones first."""
        slots = LineSlots(pacer)
        slots.start()
        self._parts = RunnerParts(self.store, self.off_loop, self.files, executor, slots, caller_for)
        for batch in await self.off_loop(self.store.active_batches):
            self._launch(batch.id)

    async def stop(self) -> None:
        """Stop every runner (lines in flight stay undone: the next start runs them) and close the store."""
        tasks = [task for _, task in self._runners.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runners.clear()
        if self._parts is not None:
            await self._parts.slots.stop()
        self._db_thread.shutdown(wait=True)
        self.store.close()
        self._lock_file.close()  # and with it the lock

    def pacing_state(self) -> PacingState:
        if self._parts is None:
            return PacingState()
        slots = self._parts.slots
        return PacingState(slots.in_flight, slots.pacer.limit, slots.finished_output, slots.finished_error)

    def _launch(self, batch_id: str) -> None:
        if self._parts is None:
            return  # not serving yet: start() picks it up
        runner = BatchRunner(batch_id, self._parts)
        task = asyncio.create_task(runner.run(), name=f"batch-runner-{batch_id}")
        self._runners[batch_id] = (runner, task)
        task.add_done_callback(lambda _: self._runners.pop(batch_id, None))

    # Files.
    async def _check_file_quota(self, tenant: str) -> None:
        if await self.off_loop(self.store.count_files, tenant) >= self.limits.max_files_per_tenant:
            raise BatchRequestError(429, f"Tenant {tenant!r} holds {self.limits.max_files_per_tenant} files, its limit: "
                                         "delete some first.", code="quota_exceeded")  # fmt: skip

    async def upload(self, tenant: str, content_type: str | None, chunks: AsyncIterator[bytes]) -> FileRecord:
        """A multipart upload (`POST /v1/files`)."""
        await self._check_file_quota(tenant)
        file_id = new_file_id()
        partial = self.files.partial_path(file_id)
        try:
            upload = await receive_upload(content_type, chunks, partial, self.limits.max_file_bytes)
            purpose = upload.fields.get("purpose")
            if purpose != "batch":
                raise BatchRequestError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
            await self.off_loop(self.files.commit, file_id)
        except UploadTooLarge as exc:
            raise BatchRequestError(413, f"{exc} (--max-batch-file-mb)", param="file", code="file_too_large") from exc
        except UploadError as exc:
            raise BatchRequestError(400, str(exc), param="file") from exc
        finally:
            partial.unlink(missing_ok=True)
        record = FileRecord(file_id, tenant, "batch", upload.filename or "upload.jsonl", upload.bytes, int(time.time()))
        await self.off_loop(self.store.add_file, record)
        return record

    async def add_file(self, tenant: str, filename: str, chunks: AsyncIterator[bytes]) -> FileRecord:
        """A batch input file from a stream of its bytes (`servelm run-batch`: a path or a URL)."""
        await self._check_file_quota(tenant)
        file_id = new_file_id()
        partial = self.files.partial_path(file_id)
        size = 0
        try:
            with partial.open("wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.limits.max_file_bytes:
                        raise BatchRequestError(413, f"the file is over the limit of {self.limits.max_file_bytes} bytes")
                    await self.off_loop(f.write, chunk)
            await self.off_loop(self.files.commit, file_id)
        finally:
            partial.unlink(missing_ok=True)
        record = FileRecord(file_id, tenant, "batch", filename, size, int(time.time()))
        await self.off_loop(self.store.add_file, record)
        return record

    async def get_file(self, tenant: str, file_id: str) -> FileRecord:
        return _owned(await self.off_loop(self.store.get_file, file_id), tenant, "File", file_id)

    async def list_files(self, tenant: str, purpose: str | None, limit: int, after: str | None, order: str) -> tuple[list[FileRecord], bool]:
        """Up to `limit` files and whether more follow."""
        records = await self.off_loop(self.store.list_files, tenant, purpose, limit + 1, after, order != "asc")
        return records[:limit], len(records) > limit

    def file_path(self, record: FileRecord) -> Path:
        return self.files.path(record.id)

    async def delete_file(self, tenant: str, file_id: str) -> None:
        await self.get_file(tenant, file_id)
        if any(b.input_file_id == file_id for b in await self.off_loop(self.store.active_batches)):
            raise BatchRequestError(400, f"{file_id} is the input of a batch that has not finished: cancel it first",
                                    param="file_id", code="file_in_use")  # fmt: skip
        await self.off_loop(self.store.delete_file, file_id)
        await self.off_loop(self.files.delete, file_id)

    # Batches.
    async def create_batch(self, tenant: str, input_file_id: str, endpoint: str, completion_window: str,
                           metadata: dict[str, str] | None) -> BatchRecord:  # fmt: skip
        if endpoint not in BATCH_ENDPOINTS:
            raise BatchRequestError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}",
                                    param="endpoint", code="invalid_value")  # fmt: skip
        try:
            window_s = completion_window_seconds(completion_window)
        except ValueError as exc:
            raise BatchRequestError(400, str(exc), param="completion_window", code="invalid_value") from exc
        _check_metadata(metadata)
        record = await self.get_file(tenant, input_file_id)
        if record.purpose != "batch":
            raise BatchRequestError(400, f"{input_file_id} was not uploaded with purpose 'batch'", param="input_file_id")
        if await self.off_loop(self.store.count_active_batches, tenant) >= self.limits.max_batches_per_tenant:
            raise BatchRequestError(429, f"Tenant {tenant!r} has {self.limits.max_batches_per_tenant} unfinished "
                                         "batches, its limit.", code="quota_exceeded")  # fmt: skip
        batch = BatchRecord(f"batch_{uuid.uuid4().hex}", tenant, endpoint, input_file_id, completion_window, window_s,
                            int(time.time()), metadata=metadata)  # fmt: skip
        await self.off_loop(self.store.add_batch, batch)
        self._launch(batch.id)
        return batch

    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord:
        return _owned(await self.off_loop(self.store.get_batch, batch_id), tenant, "Batch", batch_id)

    async def list_batches(self, tenant: str, limit: int, after: str | None) -> tuple[list[BatchRecord], bool]:
        records = await self.off_loop(self.store.list_batches, tenant, limit + 1, after)
        return records[:limit], len(records) > limit

    async def cancel_batch(self, tenant: str, batch_id: str) -> BatchRecord:
        batch = await self.get_batch(tenant, batch_id)
        if batch.status not in ACTIVE_STATUSES:
            raise BatchRequestError(409, f"Cannot cancel a batch with status {batch.status!r}.", code="invalid_state")
        if await self.off_loop(self.store.mark_cancelling, batch_id, int(time.time())):
            running = self._runners.get(batch_id)
            if running is not None:
                running[0].cancel()
            else:
                self._launch(batch_id)
        return await self.get_batch(tenant, batch_id)


Owned = TypeVar("Owned", FileRecord, BatchRecord)


def _owned(record: Owned | None, tenant: str, kind: str, object_id: str) -> Owned:
    """`record` if it exists and is `tenant`'s; else a 404, the same whether it is missing or another's."""
    if record is None or record.tenant != tenant:
        raise BatchRequestError(404, f"No such {kind} object: {object_id}", param=f"{kind.lower()}_id", code="not_found")
    return record


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > 16 or any(len(k) > 64 or not isinstance(v, str) or len(v) > 512 for k, v in metadata.items()):
        raise BatchRequestError(400, "metadata takes at most 16 pairs, keys of at most 64 characters and string "
                                     "values of at most 512", param="metadata", code="invalid_value")  # fmt: skip
