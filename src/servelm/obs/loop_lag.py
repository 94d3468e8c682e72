"""Event-loop lag of the API process: how long a callback that is ready waits before it runs.

Every SSE write, every new request's parse and every engine output batch of the API process
runs on one event loop; while something blocks it (a tokenization on the loop, a GC pause,
JSON of a huge body), all of them wait. A timer measures that wait directly: a task sleeps
`interval_s` again and again and records how much later than asked it woke up.

    asked ──interval_s──▶ due ──lag──▶ woke        lag = woke - asked - interval_s  (≥ 0)

An idle or I/O-bound loop wakes it within the timer's resolution (about a millisecond); a
blocking call shows up as one sample as long as the call. The cost is one timer per interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 0.05


class EventLoopLagMonitor:
    """Samples the running loop's lag into `observe` (seconds) every `interval_s`.

    Contract: `start()` from a coroutine on the loop to watch (once; a second call raises);
    `stop()` from the same loop, synchronous, safe to call twice or before `start()`.
    `observe` runs on the loop and must not block.
    """

    def __init__(self, observe: Callable[[float], None], interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self.interval_s = interval_s
        self._observe = observe
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("this EventLoopLagMonitor is already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="servelm-event-loop-lag")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            # perf_counter, not loop.time(): uvloop's clock is cached per loop iteration, so it
            # would not see a callback that blocked within the iteration the timer fired in.
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self._observe(max(time.perf_counter() - asked - self.interval_s, 0.0))
