"""EngineSupervisor: restart a dead engine core, a bounded number of times, with backoff.

    core dies ─▶ AsyncEngineClient fails its in-flight requests at once ─▶ wait_exit(): how it ended (logged)
       ─▶ crashes within the last window_s, this one included, > max_restarts ?
            no  ─▶ "engine restarting (attempt k of N)": sleep 1 s, 2 s, 4 s, ... ─▶ client.restart(config)
                      └─ the new core fails to start: that is the next crash, round again
            yes ─▶ "engine crashed C times in T s; not restarting": for good (no flapping back)

Everything else in the API process stays: the tokenizer, the metrics, the HTTP server and its
connections. A replacement core gets the first core's config with what that start resolved pinned
(`restart_config`): a remote --model's download directory (no second pull, and no need for the
origin to be up), a producer's bound KV-transfer port (its consumers' peers stay valid). Its KV pool
starts empty. Requests of the dead core are not replayed here: they fail with an error that
`lost_with_core` recognises, and the server answers them 503 (Retry-After) or ends their stream with
an error event; a router in front may continue them elsewhere.

Given up, the process does NOT exit: it stays up, answering 503 with the reason on /live, /health
and /ready (and 503 to every request), and /metrics keeps `engine_restarts_total`. Under Kubernetes
the liveness probe on /live then restarts the pod, as vLLM's exit would, while the reason stays
readable until it does. A launcher without probes sees a running process: it must watch /live.
While a restart is under way /live stays 200 (the supervisor is handling it; a pod restart would
only start over) and /health is 503.

Contract: one per client, all on the API process's event loop; `start()` once the client's first
core is ready; `close()` (idempotent, synchronous) stops any restart under way; the client's
`shutdown()` then stops whatever core is left. `down()` is what the server answers while the core is
not serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from servelm.config import EngineConfig
from servelm.delivery.sources import is_remote
from servelm.engine.async_client import AsyncEngineClient, CoreExit, EngineDeadError
from servelm.engine.messages import CoreReady

logger = logging.getLogger(__name__)

# How soon a client refused during a restart should come back (about a small model's restart),
# and after the supervisor gave up (a router sends it elsewhere meanwhile; the pod gets replaced).
RESTARTING_RETRY_AFTER_S = 5
GAVE_UP_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # restarts within window_s before giving up; 0: never restart
    window_s: float = 300.0  # crashes older than this are forgiven
    first_backoff_s: float = 1.0  # before the first restart; doubling for each further crash in the window
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if not 0 <= self.first_backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 <= first_backoff_s <= max_backoff_s, got {self.first_backoff_s}, {self.max_backoff_s}")

    def backoff_s(self, attempt: int) -> float:
        """The wait before restart `attempt` (1-based): first_backoff_s, doubling, at most max_backoff_s."""
        return min(self.first_backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


@dataclass(frozen=True)
class EngineDown:
    """Why the engine is not serving, as /health, /ready and a refused request say it."""

    message: str
    retry_after_s: int


class CrashWindow:
    """The crashes within the last `window_s` seconds (monotonic times)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> int:
        """Count a crash at `now`; return how many fall within the window ending at `now`."""
        self._times.append(now)
        while self._times[0] < now - self.window_s:
            self._times.popleft()
        return len(self._times)

    def span_s(self) -> float:
        """Seconds from the first to the last crash in the window."""
        return self._times[-1] - self._times[0] if self._times else 0.0


def restart_config(config: EngineConfig, ready: CoreReady) -> EngineConfig:
    """What a replacement core gets: `config` with what the first start (`ready`) resolved pinned."""
    model = config.model
    if is_remote(model.model):
        config = replace(config, model=replace(model, model=ready.source))  # pulled there already
    transfer = config.kv_transfer
    if transfer.is_producer and transfer.kv_transfer_port == 0 and ready.kv_transfer_address:
        port = int(ready.kv_transfer_address.rsplit(":", 1)[1])  # "tcp://host:port"
        config = replace(config, kv_transfer=replace(transfer, kv_transfer_port=port))
    return config


class EngineSupervisor:
    def __init__(
        self, client: AsyncEngineClient, policy: RestartPolicy, on_restart: Callable[[], None] | None = None
    ) -> None:
        """`on_restart` is called as each replacement core is launched (whether or not it comes up)."""
        self.client = client
        self.policy = policy
        self.on_restart = on_restart
        self._crashes = CrashWindow(policy.window_s)
        self._attempt = 0  # the restart under way (1..max_restarts); 0: none
        self._gave_up: str | None = None
        self._config: EngineConfig | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        assert self.client.ready is not None, "start the supervisor once the first core is ready"
        self._config = restart_config(self.client.config, self.client.ready)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-supervisor")
        self._task.add_done_callback(self._on_done)

    def close(self) -> None:
        """Restart nothing more (shutdown): a restart under way is abandoned; the client stops its core."""
        if self._task is not None:
            self._task.cancel()

    async def wait_closed(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def gave_up(self) -> str | None:
        """Why the supervisor stopped restarting the core (for good); None while it has not."""
        return self._gave_up

    def down(self) -> EngineDown | None:
        """None while a core serves; else why not, and when to come back."""
        if self._gave_up is not None:
            return EngineDown(self._gave_up, GAVE_UP_RETRY_AFTER_S)
        if self.client.dead_error is None:
            return None
        if self._attempt == 0:  # just died: the supervisor has not counted it yet (or was closed)
            return EngineDown("engine core died", RESTARTING_RETRY_AFTER_S)
        return EngineDown(f"engine restarting (attempt {self._attempt} of {self.policy.max_restarts})",
                          RESTARTING_RETRY_AFTER_S)  # fmt: skip

    async def _run(self) -> None:
        while await self._recover(await self.client.wait_exit()):
            pass

    async def _recover(self, ended: CoreExit) -> bool:
        """Restart after the core ended as `ended` until one is ready (True) or the budget is spent (False)."""
        while True:
            crashes = self._crashes.record(time.monotonic())
            if crashes > self.policy.max_restarts:
                self._give_up(crashes, ended)
                return False
            self._attempt = crashes
            delay = self.policy.backoff_s(crashes)
            logger.error("engine core died (%s); restarting it in %.1f s (attempt %d of %d)",
                         ended.describe(), delay, crashes, self.policy.max_restarts)  # fmt: skip
            await asyncio.sleep(delay)
            if self.on_restart is not None:
                self.on_restart()
            began = time.monotonic()
            assert self._config is not None
            # The adapters served now, run-time loads and unloads included (the client keeps them).
            config = replace(self._config, lora=self.client.config.lora)
            try:
                await self.client.restart(config)
            except EngineDeadError:
                ended = await self.client.wait_exit()  # logged as the next round's crash
                continue
            logger.warning("engine core restarted (attempt %d of %d) in %.1f s; serving again",
                           crashes, self.policy.max_restarts, time.monotonic() - began)  # fmt: skip
            self._attempt = 0
            return True

    def _on_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug: never a silent "restarting" for ever
            logger.error("the engine supervisor failed", exc_info=task.exception())
            self._gave_up = "engine supervision failed (the server log says why); not restarting"

    def _give_up(self, crashes: int, ended: CoreExit) -> None:
        self._attempt = 0
        policy = self.policy
        how_often = f"{crashes} times in {self._crashes.span_s():.0f} s" if crashes > 1 else "once"
        self._gave_up = (f"engine crashed {how_often} (at most {policy.max_restarts} restarts in "
                         f"{policy.window_s:g} s); not restarting")  # fmt: skip
        logger.error("engine core died (%s); %s", ended.describe(), self._gave_up)
