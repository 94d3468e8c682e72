"""AsyncEngineClient: the API process's handle on an engine core running in its own process.

    add_request() ──PUSH──▶ core process ──PUSH──▶ output task ──▶ per-request asyncio.Queue

Contract (all methods called from the API process's event loop):
- `start()` spawns the core and returns once it reports ready (or raises its error); meanwhile
  `on_phase` (if set) hears each start-up phase the core enters.
- `add_request()` returns a queue that receives that request's EngineOutputs in order;
  the last one has a finish_reason. Calling it twice with one id is an error.
- `abort()` is safe to call for finished or unknown ids, and twice.
- If the core process dies, every open queue receives an EngineOutput with
  finish_reason ERROR and the error text, and later add_request() calls raise
  EngineDeadError: never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Callable

import zmq
import zmq.asyncio

from servelm.config import EngineConfig
from servelm.datatypes import EngineOutput, EngineRequest, EventType, FinishReason
from servelm.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStarting,
    OutputBatch,
    Shutdown,
    from_core_decoder,
    to_core_encoder,
)
from servelm.schemas.core_stats import CoreStats

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


def _not_first_token(output: EngineOutput) -> bool:
    return not any(event.type is EventType.FIRST_TOKEN for event in output.events)


def _core_process_entry(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The spawned process's target. Importing core_process (and so torch and the model code)
    here rather than at module level keeps the API process light and lets it spawn the core
    first: both processes then import and load concurrently instead of one after the other."""
    from servelm.engine.core_process import run_engine_core

    run_engine_core(config, input_address, output_address)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0) -> None:
        self.config = config
        self.startup_timeout_s = startup_timeout_s
        self.ready: CoreReady | None = None
        self.stats = CoreStats()
        self.on_stats: Callable[[CoreStats], None] | None = None  # called with every batch's stats
        self.on_phase: Callable[[str], None] | None = None  # called with each start-up phase the core enters
        self.last_batch_timestamp = 0.0
        self.dead_error: str | None = None
        self._queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._ipc_dir = tempfile.mkdtemp(prefix="servelm-ipc-")
        self._context = zmq.asyncio.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._from_core = self._context.socket(zmq.PULL)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def start(self) -> CoreReady:
        input_address = f"ipc://{self._ipc_dir}/input-{uuid.uuid4().hex[:8]}"
        output_address = f"ipc://{self._ipc_dir}/output-{uuid.uuid4().hex[:8]}"
        self._to_core.bind(input_address)
        self._from_core.bind(output_address)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=_core_process_entry,
            args=(self.config, input_address, output_address),
            name="servelm-engine-core",
            daemon=True,
        )
        self._process.start()
        self.ready = await self._wait_ready()
        self._tasks = [
            asyncio.create_task(self._output_loop(), name="engine-outputs"),
            asyncio.create_task(self._watch_process(), name="engine-watchdog"),
        ]
        return self.ready

    async def _wait_ready(self) -> CoreReady:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if await self._from_core.poll(timeout=200):
                message = from_core_decoder.decode(await self._from_core.recv())
                if isinstance(message, CoreReady):
                    return message
                if isinstance(message, CoreStarting) and self.on_phase is not None:
                    self.on_phase(message.phase)
                if isinstance(message, CoreFailed):
                    raise EngineDeadError(f"engine core failed to start:\n{message.error}")
            if self._process is not None and not self._process.is_alive():
                raise EngineDeadError(f"engine core exited during start-up (exit code {self._process.exitcode})")
        raise EngineDeadError(f"engine core not ready after {self.startup_timeout_s:.0f} s")

    async def add_request(self, request: EngineRequest) -> asyncio.Queue[EngineOutput]:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        await self._to_core.send(to_core_encoder.encode(AddRequest(request=request)))
        return queue

    async def abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._queues.pop(rid, None) is not None]
        if live and self.dead_error is None:
            await self._to_core.send(to_core_encoder.encode(AbortRequests(request_ids=live)))

    async def _output_loop(self) -> None:
        while True:
            message = from_core_decoder.decode(await self._from_core.recv())
            if isinstance(message, CoreFailed):
                self._fail_all(f"engine core failed: {message.error}")
                return
            if not isinstance(message, OutputBatch):
                continue
            self.stats = message.stats
            self.last_batch_timestamp = message.timestamp
            if self.on_stats is not None:
                self.on_stats(message.stats)
            # Waiters run in the order their queues are filled, and a step's batch takes the API a
            # while to write out (~0.1 ms per stream): first tokens go first, as TTFT is the
            # latency users feel most; a decode token waits at most that one batch longer.
            for output in sorted(message.outputs, key=_not_first_token):
                queue = self._queues.get(output.request_id)
                if queue is None:
                    continue  # aborted on this side already
                if output.finish_reason is not None:
                    del self._queues[output.request_id]
                queue.put_nowait(output)

    async def _watch_process(self) -> None:
        while self._process is not None and self._process.is_alive():
            await asyncio.sleep(0.2)
        if self.dead_error is None:
            code = self._process.exitcode if self._process is not None else None
            self._fail_all(f"engine core process died (exit code {code})")

    def _fail_all(self, error: str) -> None:
        self.dead_error = error
        logger.error(error)
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(
                EngineOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error)
            )
        self._queues.clear()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core: Shutdown, then a kill after `timeout_s`. A core still starting reads no
        messages until it is ready: it is terminated at once (its start-up is abandoned)."""
        for task in self._tasks:
            task.cancel()
        if self._process is not None and self._process.is_alive():
            if self.ready is None:
                self._process.terminate()
            else:
                await self._to_core.send(to_core_encoder.encode(Shutdown()))
            deadline = time.monotonic() + timeout_s
            while self._process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._process.is_alive():
                self._process.kill()
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        for name in os.listdir(self._ipc_dir):
            os.unlink(os.path.join(self._ipc_dir, name))
        os.rmdir(self._ipc_dir)

    @property
    def process_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None
