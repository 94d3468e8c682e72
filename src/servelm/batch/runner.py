"""One batch from where it stands to its end, resumable at any point:

    validating ─▶ in_progress ─▶ finalizing ─▶ completed
        └─▶ failed       ├─ cancel ─▶ cancelling ─▶ finalizing ─▶ cancelled   (partial output kept)
                         └─ window over ──────────▶ finalizing ─▶ expired     (lines not run: error file)

Validation reads the input once and keeps each line's place (not its text) in the store. Lines
run through the server's own app (executor.py), as many at once as the shared allowance lets
(LineSlots, paced by pacing.py); a 429 or 503 is waited out and tried again, any other answer is
the line's result, kept in the store in the transaction that marks the line done. The output
and error files are written from those rows, in input order, once the batch ends; a restart
anywhere finds each line done or pending and goes on (the store's docstring says why that is
exactly once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from servelm.batch.executor import AppExecutor, LineResponse
from servelm.batch.files import FileStore
from servelm.batch.input_file import BatchInvalid, new_result_id, scan_input
from servelm.batch.pacing import BatchPacer
from servelm.batch.records import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    LINE_ERROR,
    LINE_OUTPUT,
    VALIDATING,
    BatchError,
    BatchRecord,
    FileRecord,
    PendingLine,
    result_line,
)
from servelm.batch.store import BatchStore, DuplicateCustomId
from servelm.tenancy.config import BUILTIN_CLASSES

logger = logging.getLogger(__name__)
BATCH_PRIORITY = BUILTIN_CLASSES["batch"].priority
PAGE_LINES = 256  # pending lines read from the store at once
PACE_TICK_S = 0.25
RETRY_AFTER_BOUNDS_S = (0.1, 30.0)  # how long a 429/503 line waits before it is tried again
EXPIRED_ERROR = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}
INTERNAL_ERROR = {"error": {"message": "The server failed to run this line; its log says why.", "type": "server_error",
                            "param": None, "code": "internal_error"}}  # fmt: skip
STREAM_REFUSED = {"error": {"message": "stream is not supported in a batch: the line's response is kept whole",
                            "type": "invalid_request_error", "param": "stream", "code": None}}  # fmt: skip

# A store method run off the event loop (the service's one database thread).
OffLoop = Callable[..., Awaitable[Any]]


class LineSlots:
    """The batch lines in flight, all batches together, within the pacer's allowance."""

    def __init__(self, pacer: BatchPacer) -> None:
        self.pacer = pacer
        self.in_flight = 0
        self.finished_output = self.finished_error = 0  # lines ended since start-up (the metrics)
        self._room = asyncio.Event()  # set whenever a waiter may find room: it checks again
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick(), name="batch-pacer")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)

    async def acquire(self) -> None:
        while self.in_flight >= self.pacer.limit:
            self._room.clear()
            await self._room.wait()
        self.in_flight += 1

    def release(self) -> None:
        """Synchronous, so that a cancelled line frees its slot in its `finally` whatever happens."""
        self.in_flight -= 1
        self._room.set()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(PACE_TICK_S)
            before = self.pacer.limit
            if self.pacer.tick(self.in_flight) > before:
                self._room.set()


@dataclass
class RunnerParts:
    """What every runner shares: the store (called off the loop), the files, the app, the allowance."""

    store: BatchStore
    off_loop: OffLoop
    files: FileStore
    executor: AppExecutor
    slots: LineSlots
    caller_for: Callable[[str], object]  # a tenant's name → the caller its lines run as (the batch class)


class BatchRunner:
    def __init__(self, batch_id: str, parts: RunnerParts) -> None:
        self.batch_id = batch_id
        self.parts = parts
        self._stop = asyncio.Event()  # set by cancel()

    def cancel(self) -> None:
        """Stop at once (the service has stored the batch as cancelling): lines in flight are
        aborted and stay undone; those done are written out."""
        self._stop.set()

    async def run(self) -> None:
        store, off_loop = self.parts.store, self.parts.off_loop
        batch = await off_loop(store.get_batch, self.batch_id)
        if batch.status == VALIDATING:
            batch = await self._validate(batch)
        if batch.status == IN_PROGRESS:
            ending = await self._run_lines(batch)
            batch = await off_loop(store.get_batch, self.batch_id)  # the counts, and a cancel's status
            await self._finalize(batch, ending)
        elif batch.status == CANCELLING:
            await self._finalize(batch, CANCELLED)
        elif batch.status == FINALIZING:  # a restart in the middle of writing the files: write them again
            await self._finalize(batch, batch.ending or COMPLETED)

    async def _validate(self, batch: BatchRecord) -> BatchRecord:
        store, off_loop = self.parts.store, self.parts.off_loop
        path = self.parts.files.path(batch.input_file_id)
        try:
            await off_loop(store.replace_lines, batch.id, scan_input(path, batch.endpoint))
        except BatchInvalid as exc:
            return await self._fail(batch, exc.error)
        except DuplicateCustomId as exc:
            return await self._fail(batch, BatchError("duplicate_custom_id", str(exc), "custom_id", exc.line_no))
        except OSError as exc:
            return await self._fail(batch, BatchError("file_unreadable", f"The input file could not be read: {exc}"))
        latest = await off_loop(store.get_batch, batch.id)
        if latest.status == CANCELLING:  # cancelled while its input was read
            return latest
        batch.status, batch.in_progress_at = IN_PROGRESS, int(time.time())
        await off_loop(store.save_batch, batch)
        return batch

    async def _fail(self, batch: BatchRecord, error: BatchError) -> BatchRecord:
        batch.status, batch.failed_at, batch.errors = FAILED, int(time.time()), [error]
        await self.parts.off_loop(self.parts.store.save_batch, batch)
        await self.parts.off_loop(self.parts.store.drop_lines, batch.id)
        return batch

    async def _run_lines(self, batch: BatchRecord) -> str:
        """COMPLETED when every line is done, CANCELLED when cancelled, EXPIRED when the window ran out."""
        dispatch = asyncio.create_task(self._dispatch(batch), name=f"batch-{batch.id}")
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({dispatch, stop}, timeout=max(0.0, batch.expires_at - time.time()),
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            for task in (dispatch, stop):
                task.cancel()
            await asyncio.gather(dispatch, stop, return_exceptions=True)
        if self._stop.is_set():
            return CANCELLED
        if dispatch.done() and not dispatch.cancelled() and dispatch.exception() is None:
            return COMPLETED
        if dispatch.done() and not dispatch.cancelled():
            raise dispatch.exception()  # type: ignore[misc]
        return EXPIRED

    async def _dispatch(self, batch: BatchRecord) -> None:
        """Run every pending line, within the allowance; returns once all are done."""
        running: set[asyncio.Task[None]] = set()
        try:
            after = 0
            while page := await self.parts.off_loop(self.parts.store.pending_lines, batch.id, after, PAGE_LINES):
                for line in page:
                    await self.parts.slots.acquire()
                    task = asyncio.create_task(self._run_line(batch, line))
                    running.add(task)
                    task.add_done_callback(running.discard)
                after = page[-1].line_no
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _run_line(self, batch: BatchRecord, line: PendingLine) -> None:
        try:
            try:
                response = await self._execute(batch, line)
            except Exception:  # a bug on one line must not stall the batch: the line fails, logged
                logger.exception("batch %s line %d failed inside the server", batch.id, line.line_no)
                response = LineResponse(500, INTERNAL_ERROR, None)
            body = response.body
            request_id = body.get("id") if isinstance(body.get("id"), str) else new_result_id()
            result = result_line(new_result_id(), line.custom_id,
                                 {"status_code": response.status_code, "request_id": request_id, "body": body}, None)  # fmt: skip
            in_output = 200 <= response.status_code < 300
            await self.parts.off_loop(self.parts.store.finish_line, batch.id, line.line_no, in_output, result, _usage(body))
            if in_output:
                self.parts.slots.finished_output += 1
            else:
                self.parts.slots.finished_error += 1
        finally:
            self.parts.slots.release()

    async def _execute(self, batch: BatchRecord, line: PendingLine) -> LineResponse:
        text = await self.parts.off_loop(self.parts.files.read_at, batch.input_file_id, line.offset, line.length)
        body = json.loads(text)["body"]
        if body.get("stream"):
            return LineResponse(400, STREAM_REFUSED, None)
        # Never ahead of the batch class (lower runs first): what a replica behind the router
        # goes by; the server puts the line in the class anyway (its caller is in it).
        given = body.get("priority")
        body["priority"] = max(given if isinstance(given, int) else 0, BATCH_PRIORITY)
        payload = json.dumps(body).encode()
        caller = self.parts.caller_for(batch.tenant)
        while True:
            response = await self.parts.executor.post(batch.endpoint, payload, caller)
            if response.status_code not in (429, 503):
                return response
            low, high = RETRY_AFTER_BOUNDS_S
            await asyncio.sleep(min(high, max(low, response.retry_after_s or 1.0)))

    async def _finalize(self, batch: BatchRecord, final_status: str) -> None:
        store, off_loop, files = self.parts.store, self.parts.off_loop, self.parts.files
        if batch.status != FINALIZING:
            batch.status, batch.finalizing_at, batch.ending = FINALIZING, int(time.time()), final_status
            await off_loop(store.save_batch, batch)
        if final_status == EXPIRED:
            await self._expire_pending(batch)
        _, completed, failed = await off_loop(store.counts, batch.id)
        for state, count, attribute, suffix in ((LINE_OUTPUT, completed, "output_file_id", "output"),
                                                (LINE_ERROR, failed, "error_file_id", "error")):  # fmt: skip
            if count == 0:
                continue
            file_id = _result_file_id(batch.id, suffix)  # the same on a rerun: a restart rewrites, never duplicates
            size = await off_loop(files.write_lines, file_id, store.results(batch.id, state))
            record = FileRecord(file_id, batch.tenant, "batch_output", f"{batch.id}_{suffix}.jsonl", size, int(time.time()))
            await off_loop(_replace_file, store, record)
            setattr(batch, attribute, file_id)
        now = int(time.time())
        batch.status = final_status
        if final_status == COMPLETED:
            batch.completed_at = now
        elif final_status == CANCELLED:
            batch.cancelled_at = now
        else:
            batch.expired_at = now
        await off_loop(store.save_batch, batch)
        await off_loop(store.drop_lines, batch.id)
        logger.info("batch %s %s: %d lines in its output, %d in its error file", batch.id, final_status, completed, failed)

    async def _expire_pending(self, batch: BatchRecord) -> None:
        store, off_loop = self.parts.store, self.parts.off_loop
        while page := await off_loop(store.pending_lines, batch.id, 0, PAGE_LINES):
            for line in page:
                result = result_line(new_result_id(), line.custom_id, None, EXPIRED_ERROR)
                await off_loop(store.finish_line, batch.id, line.line_no, False, result)


def _usage(body: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, cached prompt, completion) tokens of a response's `usage`; zeros where it has none."""
    raw_usage = body.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    raw_details = usage.get("prompt_tokens_details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}

    def count(value: object) -> int:
        return value if isinstance(value, int) else 0

    return count(usage.get("prompt_tokens")), count(details.get("cached_tokens")), count(usage.get("completion_tokens"))


def _result_file_id(batch_id: str, suffix: str) -> str:
    return f"file-{batch_id.removeprefix('batch_')}-{suffix}"


def _replace_file(store: BatchStore, record: FileRecord) -> None:
    store.delete_file(record.id)
    store.add_file(record)
