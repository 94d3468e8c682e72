"""`servelm run-batch -i FILE|URL -o FILE`: an OpenAI batch input file through the engine offline, as
vLLM's `run-batch` does, on the same machinery as the server's Batch API (the app runs in this
process, without a socket): the same validation, line format and exactly-once store.

Resumable: the batch and its progress live under --data-dir (default: the user's data directory,
run-batch/), keyed by the input's content (a URL: by the URL), so running the same command again
after an interruption (Ctrl-C, a crash, kill -9) runs only the lines not done yet. The output
file holds every line's result in input order, successes and failures together (vLLM's format:
each line's `response.status_code` tells them apart; a line that is not JSON has `error`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from servelm import envs
from servelm.batch.arguments import BatchOptions
from servelm.batch.files import FileStore
from servelm.batch.input_file import scan_input
from servelm.batch.records import ACTIVE_STATUSES, BATCH_ENDPOINTS, COMPLETED, BatchRecord
from servelm.batch.service import BatchRequestError, BatchService
from servelm.config import EngineConfig
from servelm.server.app import ServerOptions, create_app
from servelm.server.lifecycle import ServerLifecycle
from servelm.tenancy.config import DEFAULT_TENANT

logger = logging.getLogger(__name__)
POLL_S = 0.5
RUNS_FILE = "runs.json"  # input key → batch id, for resuming


@dataclass(frozen=True)
class RunBatchOptions:
    input: str  # a path or an http(s) URL
    output: Path
    data_dir: Path | None = None  # None: envs.data_dir()/run-batch

    @property
    def batch_data_dir(self) -> Path:
        return self.data_dir if self.data_dir is not None else envs.data_dir() / "run-batch"


def run_batch(engine_config: EngineConfig, options: RunBatchOptions) -> int:
    """0 when every line ran (each line's own status is in the output), 1 when the batch failed
    validation or the engine did not start, 2 when the input cannot be read."""
    try:
        return asyncio.run(_run(engine_config, options))
    except (OSError, httpx.HTTPError, BatchRequestError) as exc:
        logger.error("run-batch: %s", exc)
        return 2


async def _run(engine_config: EngineConfig, options: RunBatchOptions) -> int:
    data_dir = options.batch_data_dir
    app = create_app(engine_config, ServerOptions(batch=BatchOptions(data_dir=data_dir, max_batch_file_mb=float(2**20))))
    async with app.router.lifespan_context(app):
        if not await _serving(app.state.lifecycle):
            logger.error("run-batch: the engine did not start: %s", app.state.lifecycle.failure)
            return 1
        service = app.state.batches
        if not isinstance(service, BatchService):
            logger.error("run-batch: %s", service)
            return 1
        batch = await _resume_or_create(service, options)
        batch = await _follow(service, batch)
        if batch.status != COMPLETED:
            for error in batch.errors:
                logger.error("run-batch: the input is invalid: %s (line %s)", error.message, error.line)
            return 1
        lines = await service.off_loop(_write_output, service.files, batch, options.output)
        logger.info("run-batch: %d results written to %s (%d failed)", lines, options.output, batch.failed)
        await service.off_loop(_forget_run, data_dir, batch.id)
    return 0


async def _serving(lifecycle: ServerLifecycle) -> bool:
    while lifecycle.ctx is None and lifecycle.failure is None:
        await asyncio.sleep(0.1)
    return lifecycle.ctx is not None


async def _resume_or_create(service: BatchService, options: RunBatchOptions) -> BatchRecord:
    key = await service.off_loop(_input_key, options.input)
    runs = await service.off_loop(_read_runs, service.data_dir)
    if key in runs:
        try:
            batch = await service.get_batch(DEFAULT_TENANT, runs[key])
        except BatchRequestError:
            batch = None
        if batch is not None and (batch.status in ACTIVE_STATUSES or batch.status == COMPLETED):
            logger.info("run-batch: resuming %s (%d of %d lines done)", batch.id, batch.completed + batch.failed, batch.total)
            return batch
    if options.input.startswith(("http://", "https://")):
        record = await service.add_file(DEFAULT_TENANT, Path(options.input).name or "input.jsonl", _download(options.input))
    else:
        record = await service.add_file(DEFAULT_TENANT, Path(options.input).name, _read_chunks(Path(options.input)))
    endpoint = await service.off_loop(_endpoint_of, service.files.path(record.id))
    batch = await service.create_batch(DEFAULT_TENANT, record.id, endpoint, "24h", None)
    runs[key] = batch.id
    await service.off_loop(_write_runs, service.data_dir, runs)
    return batch


async def _follow(service: BatchService, batch: BatchRecord) -> BatchRecord:
    """Wait for the batch to end, with a progress bar of its lines on stderr."""
    with tqdm(total=batch.total or None, unit="line", desc="run-batch", file=sys.stderr) as bar:
        while True:
            batch = await service.get_batch(DEFAULT_TENANT, batch.id)
            bar.total = batch.total or bar.total
            bar.n = batch.completed + batch.failed
            bar.set_postfix(failed=batch.failed, refresh=False)
            bar.refresh()
            if batch.status not in ACTIVE_STATUSES:
                return batch
            await asyncio.sleep(POLL_S)


async def _read_chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(size):
            yield chunk


async def _download(url: str) -> AsyncIterator[bytes]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), follow_redirects=True) as client:
        async with client.stream("GET", url) as response:
            response.raise_for_status()
            async for chunk in response.aiter_bytes():
                yield chunk


def _input_key(source: str) -> str:
    if source.startswith(("http://", "https://")):
        return "url:" + source
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _endpoint_of(path: Path) -> str:
    """The `url` of the input's first line that is JSON (every line must share it: validation checks)."""
    with path.open("rb") as f:
        for raw in f:
            try:
                url = json.loads(raw).get("url")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                continue
            return url if url in BATCH_ENDPOINTS else BATCH_ENDPOINTS[0]
    return BATCH_ENDPOINTS[0]


def _read_runs(data_dir: Path) -> dict[str, str]:
    try:
        return json.loads((data_dir / RUNS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_runs(data_dir: Path, runs: dict[str, str]) -> None:
    partial = data_dir / f".{RUNS_FILE}.partial"
    partial.write_text(json.dumps(runs))
    os.replace(partial, data_dir / RUNS_FILE)


def _forget_run(data_dir: Path, batch_id: str) -> None:
    _write_runs(data_dir, {k: v for k, v in _read_runs(data_dir).items() if v != batch_id})


def _write_output(files: FileStore, batch: BatchRecord, output: Path) -> int:
    """The output and error files merged in input order: each holds its lines in input order, so
    walking the input's custom_ids picks the next line from whichever file it is at the head of."""
    count = 0
    partial = output.with_name(f".{output.name}.partial")
    with partial.open("w") as out:
        results = _MergedResults(_lines(files, batch.output_file_id), _lines(files, batch.error_file_id))
        for _, custom_id, *_ in scan_input(files.path(batch.input_file_id), batch.endpoint):
            line = results.take(custom_id)
            if line is not None:
                out.write(line)
                count += 1
    os.replace(partial, output)
    return count


def _lines(files: FileStore, file_id: str | None) -> Iterator[str]:
    if file_id is None:
        return
    with files.path(file_id).open() as f:
        yield from f


class _MergedResults:
    def __init__(self, *streams: Iterator[str]) -> None:
        self.streams = streams
        self.heads: list[tuple[str | None, str] | None] = [self._next(s) for s in streams]

    @staticmethod
    def _next(stream: Iterator[str]) -> tuple[str | None, str] | None:
        line = next(stream, None)
        return (json.loads(line)["custom_id"], line) if line is not None else None

    def take(self, custom_id: str | None) -> str | None:
        for i, head in enumerate(self.heads):
            if head is not None and head[0] == custom_id:
                self.heads[i] = self._next(self.streams[i])
                return head[1]
        return None
