"""A bounded waiting queue: a request that would push more than `max_waiting` engine requests
into waiting gets 429 at once; one that alone is larger than the limit gets 400 (waiting can
never make it fit, so a 429 would send a Retry-After client round for ever).

Only what really waits counts, never what runs:

    waiting = requests being tokenized (API thread pool)
            + max(queued in the core,                       (its latest stats: one step old)
                  engine requests in flight − max_num_seqs)  (more than can ever run at once)

A request's own engine requests count as waiting (the limit bounds the queue it joins).
Queued in the core: requests it has not started after QUEUED_AFTER_S (core_stats.py), so a
prompt that step pricing holds back a step or two, to keep its neighbours' token gap, is not
counted as queueing. The second term covers a burst the core has not reported yet: whatever
exceeds the core's sequence slots waits for sure. A burst that fits in free slots is all
admitted; the core's count then catches up if KV blocks or compute, not slots, are short. While the
server drains for shutdown, or while the engine is down (restarting, or given up: the
supervisor's EngineDown), every new request gets 503 with its reason and Retry-After instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from servelm.engine.supervisor import EngineDown
from servelm.server.errors import overloaded, too_large_to_queue, unavailable


@dataclass
class Admission:
    max_waiting: int
    max_num_seqs: int  # the core's sequence slots: at most this many run at once
    num_tokenizing: Callable[[], int]
    num_engine_in_flight: Callable[[], int]
    num_core_queued: Callable[[], int]
    engine_down: Callable[[], EngineDown | None]
    draining: bool = False
    retry_after_s: int = 1

    def num_waiting(self) -> int:
        in_flight = self.num_engine_in_flight()
        beyond_slots = in_flight - self.max_num_seqs
        # The core's count is capped by what is in flight: stats never outlive their requests.
        return self.num_tokenizing() + max(min(self.num_core_queued(), in_flight), beyond_slots, 0)

    def admit(self, num_engine_requests: int) -> None:
        """Raise the 503/400/429 APIError when the request may not enter; return when it may."""
        if self.draining:
            raise unavailable("The server is shutting down and takes no new requests.")
        down = self.engine_down()
        if down is not None:
            raise unavailable(down.message, retry_after_s=down.retry_after_s)
        # A request counts as waiting itself. One larger than the limit never fits: 400, split it.
        # A single engine request is never "too large": with a limit of 0 (admit nothing, the
        # always-full replica routers are tested with) it is a 429 like any full server's.
        if num_engine_requests > max(self.max_waiting, 1):
            raise too_large_to_queue(num_engine_requests, self.max_waiting)
        waiting = self.num_waiting()
        if waiting + num_engine_requests > self.max_waiting:
            raise overloaded(self.retry_after_s, waiting, self.max_waiting)
