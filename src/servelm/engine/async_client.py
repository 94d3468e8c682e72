"""AsyncEngineClient: the API process's handle on an engine core running in its own process.

    add_request() ──PUSH──▶ core process ──PUSH──▶ output task ──▶ per-request asyncio.Queue

Contract (all methods called from the API process's event loop):
- `start()` spawns the core and returns once it reports ready (or raises its error); meanwhile
  `on_phase` (if set) hears each start-up phase the core enters.
- `add_request()` returns a queue that receives that request's EngineOutputs in order;
  the last one has a finish_reason. Calling it twice with one id is an error.
- `abort()` is safe to call for finished or unknown ids, and twice.
- If the core process dies, every open queue receives an EngineOutput with finish_reason ERROR
  and an error that `lost_with_core()` recognises, and later add_request() calls raise
  EngineDeadError: never a hang. `wait_exit()` returns once the dead process is gone (how it
  ended: exit code or signal, its traceback if it sent one); `restart()` then launches a fresh
  core (an empty KV pool) behind the same client: the queues, the callbacks and the API
  process's state stay. Each launch has its own sockets, so nothing sent to the dead core can
  reach the new one. Deciding whether to restart is not this class's job (engine.supervisor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from servelm.config import EngineConfig, LoRAModule
from servelm.datatypes import EngineOutput, EngineRequest, EventType, FinishReason
from servelm.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStarting,
    LoadLoRA,
    LoRAReply,
    OutputBatch,
    Shutdown,
    UnloadLoRA,
    from_core_decoder,
    to_core_encoder,
)
from servelm.schemas.core_stats import CoreStats
from servelm.zmq_contexts import non_lingering_async_context

logger = logging.getLogger(__name__)

# The start of the error every in-flight request gets when its core dies (lost_with_core).
CORE_LOST = "engine core lost"
# After a CoreFailed the core exits by itself (it re-raises); one still there after this long is killed.
EXIT_GRACE_S = 5.0


class EngineDeadError(RuntimeError):
    pass


def lost_with_core(error: str | None) -> bool:
    """Whether a request's error says its engine core died under it (rather than that the core
    refused or failed that request alone)."""
    return error is not None and error.startswith(CORE_LOST)


@dataclass(frozen=True)
class CoreExit:
    """How a core process ended."""

    exit_code: int | None  # negative: killed by that signal (multiprocessing's convention); None: never started
    traceback: str | None = None  # what it sent with CoreFailed, if it did (or why it could not start)

    def describe(self) -> str:
        if self.exit_code is None:
            how = "never started"
        elif self.exit_code < 0:
            try:
                how = f"killed by {signal.Signals(-self.exit_code).name}"
            except ValueError:
                how = f"killed by signal {-self.exit_code}"
        else:
            how = f"exit code {self.exit_code}"
        return how if self.traceback is None else f"{how}, after it failed:\n{self.traceback}"


def _not_first_token(output: EngineOutput) -> bool:
    return not any(event.type is EventType.FIRST_TOKEN for event in output.events)


def _core_process_entry(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The spawned process's target. Importing core_process (and so torch and the model code)
    here rather than at module level keeps the API process light and lets it spawn the core
    first: both processes then import and load concurrently instead of one after the other."""
    from servelm.engine.core_process import run_engine_core

    run_engine_core(config, input_address, output_address)
    _exit_at_once()


def _exit_at_once() -> None:
    """End the core process after a clean run_engine_core, skipping Python's finalization: what it
    must do on the way out (sockets closed, followers stopped, the KV tiers' last saves on disk) is
    done by then, and tearing down torch, the model and the KV pool took another ~1 s (tiny model,
    2 cores), which the API process waits for at every stop and restart. A core that raised exits
    the usual way, with its traceback and a non-zero status."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class _WaitingCore:
    """A core process spawned ahead of its launch: importing, then waiting for its arguments."""

    process: multiprocessing.process.BaseProcess
    arguments: multiprocessing.connection.Connection  # the API's end: (config, input, output) goes here


_waiting_core: _WaitingCore | None = None


def prestart_core_process() -> None:
    """Spawn the engine-core process now, before this process imports the API server: it imports
    torch and the model code (~4.5 s on a 2-core host) while the API imports its own (~2.5 s), on
    the other core. The first launch then hands it its arguments instead of spawning."""
    global _waiting_core
    spawn = multiprocessing.get_context("spawn")
    arguments, child_end = spawn.Pipe()
    process = spawn.Process(target=_waiting_core_entry, args=(child_end,), name="servelm-engine-core", daemon=True)
    process.start()
    child_end.close()
    _waiting_core = _WaitingCore(process, arguments)


def _waiting_core_entry(arguments: multiprocessing.connection.Connection) -> None:
    # As run_engine_core does, before its imports: a terminal's Ctrl-C reaches the whole process
    # group, and it is the API process that drains and then tells (or never tells) this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from servelm.engine.core_process import run_engine_core

    try:
        config, input_address, output_address = arguments.recv()
    except EOFError:  # the API process ended without launching an engine (a bad flag, a signal)
        return
    arguments.close()
    run_engine_core(config, input_address, output_address)
    _exit_at_once()


def _hand_to_waiting_core(
    config: EngineConfig, input_address: str, output_address: str
) -> multiprocessing.process.BaseProcess | None:
    """The prestarted core, running this launch; None when there is none (or it died waiting)."""
    global _waiting_core
    waiting, _waiting_core = _waiting_core, None
    if waiting is None:
        return None
    try:
        waiting.arguments.send((config, input_address, output_address))
    except OSError:  # it is gone (its imports failed): spawn a fresh one, which reports why
        waiting.process.join(timeout=1)
        return None
    finally:
        waiting.arguments.close()
    return waiting.process


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0) -> None:
        self.config = config  # what the next launch gets (restart() may replace it)
        self.startup_timeout_s = startup_timeout_s
        self.ready: CoreReady | None = None
        self.stats = CoreStats()
        self.on_stats: Callable[[CoreStats], None] | None = None  # called with every batch's stats
        self.on_phase: Callable[[str], None] | None = None  # called with each start-up phase the core enters
        self.last_batch_timestamp = 0.0
        self.dead_error: str | None = None
        self._queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._ipc_dir = tempfile.mkdtemp(prefix="servelm-ipc-")
        self._context = non_lingering_async_context()
        self._to_core: zmq.asyncio.Socket | None = None  # this launch's sockets
        self._from_core: zmq.asyncio.Socket | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task] = []
        self._traceback: str | None = None  # the current core's CoreFailed, if it sent one
        self._exit: asyncio.Future[CoreExit] | None = None  # the current core's end, once it ended
        self._lora_calls: dict[int, asyncio.Future[LoRAReply]] = {}  # run-time LoRA loads awaiting their reply
        self._next_call_id = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def start(self) -> CoreReady:
        return await self._launch()

    async def restart(self, config: EngineConfig | None = None) -> CoreReady:
        """Launch a fresh core (with `config`, else the last one) after the current one died: ready
        on return, or EngineDeadError (that core's end then comes from `wait_exit()`). Until it is
        ready, add_request() keeps raising EngineDeadError. RuntimeError while a core runs."""
        if self.dead_error is None:
            raise RuntimeError("the engine core is running: only a dead one is restarted")
        await self._reap()
        self._close_launch()
        if config is not None:
            self.config = config
        ready = await self._launch()
        self.dead_error = None
        return ready

    async def wait_exit(self) -> CoreExit:
        """Return once the current core has died and its process is gone (never while it serves)."""
        assert self._exit is not None, "the engine core was never launched"
        return await asyncio.shield(self._exit)

    async def _launch(self) -> CoreReady:
        self.ready, self.stats, self._traceback = None, CoreStats(), None
        self._exit = asyncio.get_running_loop().create_future()
        try:
            self._process = self._spawn()
        except Exception as exc:  # no process to watch: this launch ends here (wait_exit says how)
            self._exit.set_result(CoreExit(None, traceback.format_exc(limit=4)))
            raise EngineDeadError(f"engine core could not be launched: {exc}") from exc
        assert self._from_core is not None
        try:
            self.ready = await self._wait_ready(self._from_core)
        except EngineDeadError:
            self._tasks = [asyncio.create_task(self._watch_process(self._process), name="engine-watchdog")]
            raise
        self._tasks = [
            asyncio.create_task(self._output_loop(self._from_core), name="engine-outputs"),
            asyncio.create_task(self._watch_process(self._process), name="engine-watchdog"),
        ]
        return self.ready

    def _spawn(self) -> multiprocessing.process.BaseProcess:
        """This launch's sockets, bound, and its core process, started."""
        os.makedirs(self._ipc_dir, exist_ok=True)  # a /tmp cleaner may have removed it since the last launch
        input_address = f"ipc://{self._ipc_dir}/input-{uuid.uuid4().hex[:8]}"
        output_address = f"ipc://{self._ipc_dir}/output-{uuid.uuid4().hex[:8]}"
        self._to_core = self._context.socket(zmq.PUSH)
        self._from_core = self._context.socket(zmq.PULL)
        self._to_core.bind(input_address)
        self._from_core.bind(output_address)
        prestarted = _hand_to_waiting_core(self.config, input_address, output_address)
        if prestarted is not None:
            return prestarted
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(
            target=_core_process_entry,
            args=(self.config, input_address, output_address),
            name="servelm-engine-core",
            daemon=True,
        )
        process.start()
        return process

    async def _wait_ready(self, from_core: zmq.asyncio.Socket) -> CoreReady:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if await from_core.poll(timeout=200):
                message = from_core_decoder.decode(await from_core.recv())
                if isinstance(message, CoreReady):
                    return message
                if isinstance(message, CoreStarting) and self.on_phase is not None:
                    self.on_phase(message.phase)
                if isinstance(message, CoreFailed):
                    self._traceback = message.error
                    raise EngineDeadError(f"engine core failed to start:\n{message.error}")
            if self._process is not None and not self._process.is_alive():
                raise EngineDeadError(f"engine core exited during start-up (exit code {self._process.exitcode})")
        if self._process is not None:
            self._process.kill()  # a start-up that hangs is abandoned: wait_exit() then hears of it
        raise EngineDeadError(f"engine core not ready after {self.startup_timeout_s:.0f} s")

    async def add_request(self, request: EngineRequest) -> asyncio.Queue[EngineOutput]:
        if self.dead_error is not None or self._to_core is None:
            raise EngineDeadError(self.dead_error or "the engine core is not running")
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        await self._to_core.send(to_core_encoder.encode(AddRequest(request=request)))
        return queue

    async def abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._queues.pop(rid, None) is not None]
        if live and self.dead_error is None and self._to_core is not None:
            await self._to_core.send(to_core_encoder.encode(AbortRequests(request_ids=live)))

    async def load_lora(self, module: LoRAModule) -> LoRAReply:
        """Serve a LoRA adapter from now on (read in the core's background thread); a later core
        restart serves it too."""
        reply = await self._lora_call(LoadLoRA(self._new_call_id(), module))
        if reply.status == 200:
            self._set_lora_modules((*self.config.lora.lora_modules, module))
        return reply

    async def unload_lora(self, name: str) -> LoRAReply:
        """Stop serving adapter `name` (requests in flight with it run to their end)."""
        reply = await self._lora_call(UnloadLoRA(self._new_call_id(), name))
        if reply.status == 200:
            self._set_lora_modules(tuple(m for m in self.config.lora.lora_modules if m.name != name))
        return reply

    def _new_call_id(self) -> int:
        self._next_call_id += 1
        return self._next_call_id

    async def _lora_call(self, message: LoadLoRA | UnloadLoRA) -> LoRAReply:
        if self.dead_error is not None or self._to_core is None:
            raise EngineDeadError(self.dead_error or "the engine core is not running")
        reply: asyncio.Future[LoRAReply] = asyncio.get_running_loop().create_future()
        self._lora_calls[message.call_id] = reply
        try:
            await self._to_core.send(to_core_encoder.encode(message))
            return await reply
        finally:
            self._lora_calls.pop(message.call_id, None)

    def _set_lora_modules(self, modules: tuple[LoRAModule, ...]) -> None:
        self.config = dataclasses.replace(self.config, lora=dataclasses.replace(self.config.lora, lora_modules=modules))

    async def _output_loop(self, from_core: zmq.asyncio.Socket) -> None:
        while True:
            message = from_core_decoder.decode(await from_core.recv())
            if self.dead_error is not None:
                return  # sent just before the core died: its requests have failed already
            if isinstance(message, CoreFailed):
                self._traceback = message.error
                self._fail_all(f"{CORE_LOST}: the engine core failed:\n{message.error}")
                return
            if isinstance(message, LoRAReply):
                if (waiter := self._lora_calls.get(message.call_id)) is not None and not waiter.done():
                    waiter.set_result(message)
                continue
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

    async def _watch_process(self, process: multiprocessing.process.BaseProcess) -> None:
        """Until `process` (this launch's core) is gone: then fail what it held and resolve its exit.
        A core that reported CoreFailed but lingers past EXIT_GRACE_S is killed."""
        failed_at: float | None = None
        while process.is_alive():
            await asyncio.sleep(0.2)
            if self.dead_error is not None or self.ready is None:  # failed (CoreFailed), or failed to start
                failed_at = failed_at if failed_at is not None else time.monotonic()
                if time.monotonic() - failed_at > EXIT_GRACE_S:
                    process.kill()
        ended = CoreExit(process.exitcode, self._traceback)
        if self.dead_error is None:
            self._fail_all(f"{CORE_LOST}: the engine core process died ({ended.describe()})")
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(ended)

    def _fail_all(self, error: str) -> None:
        self.dead_error = error
        self.stats = CoreStats()  # the dead core's blocks and requests are gone with it
        logger.error(error)
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(
                EngineOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error)
            )
        self._queues.clear()
        for waiter in self._lora_calls.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(error))

    async def _reap(self) -> None:
        """Wait for the current core process to be gone (it is dead or dying: killed past the grace)."""
        if self._exit is not None:
            await self.wait_exit()
        if self._process is not None:
            self._process.join(timeout=1.0)  # exited already: collects its status

    def _close_launch(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        for socket in (self._to_core, self._from_core):
            if socket is not None:
                socket.close(linger=0)  # what was queued for a dead core is dropped with it
        self._to_core = self._from_core = None

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core: Shutdown, then a kill after `timeout_s`. A core still starting reads no
        messages until it is ready: it is terminated at once (its start-up is abandoned)."""
        for task in self._tasks:
            task.cancel()
        if self._process is not None and self._process.is_alive():
            if self.ready is None or self.dead_error is not None or self._to_core is None:
                self._process.terminate()
            else:
                await self._to_core.send(to_core_encoder.encode(Shutdown()))
            deadline = time.monotonic() + timeout_s
            while self._process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._process.is_alive():
                self._process.kill()
        self._close_launch()
        self._context.term()
        for name in os.listdir(self._ipc_dir):
            os.unlink(os.path.join(self._ipc_dir, name))
        os.rmdir(self._ipc_dir)

    @property
    def process_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None
