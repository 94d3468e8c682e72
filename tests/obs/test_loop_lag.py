"""The event-loop lag monitor sees a blocking call as one sample as long as the call, and an
idle loop as (almost) no lag; on asyncio's loop and on uvloop (what `servelm serve` runs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import uvloop

from servelm.obs.loop_lag import EventLoopLagMonitor

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_a_blocking_call_shows_as_lag(loop_name):
    samples: list[float] = []

    async def main() -> tuple[list[float], list[float]]:
        monitor = EventLoopLagMonitor(samples.append, interval_s=0.01)
        monitor.start()
        await asyncio.sleep(0.3)
        idle = list(samples)
        time.sleep(0.4)  # blocks the loop: the monitor's timer falls due meanwhile
        await asyncio.sleep(0.1)
        monitor.stop()
        monitor.stop()  # safe twice
        return idle, samples[len(idle) :]

    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        idle, after = runner.run(main())
    assert len(idle) >= 5, f"only {len(idle)} samples in 300 ms at a 10 ms interval"
    assert sorted(idle)[len(idle) // 2] < 0.05, f"an idle loop should show ~no lag: {idle}"
    blocked = [lag for lag in after if lag > 0.2]
    assert len(blocked) == 1 and 0.3 <= blocked[0] <= 1.5, f"the 400 ms block should be one sample: {after}"


def test_stop_ends_the_sampling_and_bad_arguments_are_refused():
    samples: list[float] = []

    async def main() -> int:
        monitor = EventLoopLagMonitor(samples.append, interval_s=0.005)
        monitor.stop()  # before start: nothing to do
        monitor.start()
        with pytest.raises(RuntimeError, match="already started"):
            monitor.start()
        await asyncio.sleep(0.05)
        monitor.stop()
        await asyncio.sleep(0)  # let the cancellation land
        stopped_at = len(samples)
        await asyncio.sleep(0.05)
        assert stopped_at > 0
        return stopped_at

    stopped_at = asyncio.run(main())
    assert len(samples) == stopped_at, "no samples after stop()"
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        EventLoopLagMonitor(samples.append, interval_s=0)
