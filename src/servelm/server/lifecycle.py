"""Where the server stands between listening and serving: the engine starts behind a live HTTP server.

    uvicorn listens ──▶ starting (phase: what the core is doing) ──▶ ready ──▶ draining (SIGTERM)
                              │                                      ▲   │ the core died
                              │                            restarted │   ▼ (engine.supervisor)
                              │                                   restarting ──▶ gave up: stays down
                              └──▶ failed: logged, uvicorn stopped, the process exits non-zero

What each route answers (as Kubernetes probes mean them: /live is liveness, /health and /ready are
readiness; /health is 503 until the engine serves, as TGI's, so a script that waits for it never
sends too early):

    state       /live  /health, /ready            completions, chat               /metrics
    starting    200    503 "starting: <phase>"    503 (Retry-After)               startup family only
    ready       200    200                        served                          everything
    draining    200    503                        503 (admission)                 everything
    restarting  200    503                        503 (admission, Retry-After)    everything
    gave up     503    503                        503 (admission, Retry-After)    everything
    failed      503    503                        503                             as it was

Restarting says "engine restarting (attempt k of N)"; gave up says "engine crashed C times in T s
(...); not restarting" and stays so: the process does not exit (engine.supervisor says why).

One per server (`app.state.lifecycle`); written by the start-up task and the signal handler, read
by the routes, all on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from servelm.obs.startup import PhaseRecord
from servelm.server.context import ServerContext
from servelm.server.errors import ENGINE_DOWN_MESSAGE, APIError, unavailable

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "shutting down"
# Before the core's first phase: the process spawning and importing (torch, the model code).
LAUNCHING_PHASE = "launching the engine core"
# How soon a client refused during start-up should come back.
STARTING_RETRY_AFTER_S = 5

# The server's own start: given a callback for the core's phases, returns the serving context.
StartContext = Callable[[Callable[[str], None]], Awaitable[ServerContext]]


@dataclass
class ServerLifecycle:
    phase: str = LAUNCHING_PHASE  # what start-up is doing (meaningful until ctx is set)
    ctx: ServerContext | None = None  # set once the engine is ready
    failure: str | None = None  # why start-up failed (the log has it in full)
    draining: bool = False
    on_failed: Callable[[], None] | None = None  # run_server's: stop uvicorn once start-up failed

    def liveness_problem(self) -> str | None:
        """Why /live is 503: the engine failed to start, or the supervisor gave up restarting it
        (for good: only a new process can serve again); None while it is, or may come to be, serving."""
        if self.failure is not None:
            return ENGINE_DOWN_MESSAGE
        return self.ctx.supervisor.gave_up if self.ctx is not None else None

    def readiness_problem(self) -> str | None:
        """Why /health and /ready are 503: draining, "starting: <phase>", the engine down
        (restarting, gave up) or failed; None while serving."""
        if self.draining:
            return SHUTTING_DOWN
        if self.failure is not None:
            return ENGINE_DOWN_MESSAGE
        if self.ctx is None:
            return f"starting: {self.phase}"
        down = self.ctx.supervisor.down()
        return down.message if down is not None else None

    def live_status(self) -> str:
        """/live's status while alive: starting, ok, restarting or draining."""
        if self.draining:
            return "draining"
        if self.ctx is None:
            return "starting"
        return "restarting" if self.ctx.supervisor.down() is not None else "ok"

    def serving_context(self) -> ServerContext:
        """The context of a ready engine for a route that needs one; the 503 APIError before that.
        Once ready, draining and a dead engine are the routes' and admission's to answer."""
        if self.ctx is not None:
            return self.ctx
        problem = self.readiness_problem()
        assert problem is not None
        raise _unavailable_while(problem)

    def drain(self) -> None:
        """SIGTERM/SIGINT: refuse new work from now on (and abandon a start-up still under way)."""
        self.draining = True
        if self.ctx is not None:
            self.ctx.admission.draining = True
            self.ctx.supervisor.close()  # a core that dies now is not restarted

    async def start(self, start_context: StartContext) -> None:
        """The start-up task: run `start_context`, tracking its phases; on failure log why and call
        `on_failed`. Cancelled (shutdown during start-up): `start_context` cleans up after itself."""
        launched_at = time.time()
        try:
            ctx = await start_context(self._enter_phase)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything start-up raises ends the server, with its reason
            self.failure = str(exc) or type(exc).__name__
            logger.error("engine start-up failed during %s: %s", self.phase, self.failure)
            if self.on_failed is not None:
                self.on_failed()
            return
        if ctx.engine.client.ready is not None:
            log_startup(ctx.engine.client.ready.startup, launched_at)
        if self.draining:
            ctx.admission.draining = True  # a signal arrived while the last step awaited
            ctx.supervisor.close()
        self.ctx = ctx

    def _enter_phase(self, phase: str) -> None:
        self.phase = phase


def log_startup(records: Sequence[PhaseRecord], launched_at: float) -> None:
    """One line per start-up phase (its seconds, and when it began after the core was launched at
    `launched_at`, wall clock), then the total."""
    for record in records:
        logger.info("start-up phase %-12s %7.3f s  (began at +%.3f s)", record.name, record.seconds,
                    record.started_at - launched_at)  # fmt: skip
    first = min((record.started_at for record in records), default=launched_at)
    logger.info("engine ready %.3f s after its launch (%.3f s of it before the first phase: the core "
                "process spawning and importing)", time.time() - launched_at, first - launched_at)  # fmt: skip


def _unavailable_while(problem: str) -> APIError:
    if problem == ENGINE_DOWN_MESSAGE:
        return unavailable(problem, retry_after_s=30)
    if problem == SHUTTING_DOWN:
        return unavailable("The server is shutting down and takes no new requests.")
    return unavailable(problem, retry_after_s=STARTING_RETRY_AFTER_S)
