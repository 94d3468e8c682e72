"""How many batch lines may be in flight: as many as the engine has room for beside interactive traffic.

Batch lines run in the lowest class, so each step already serves interactive requests first and
preempts batch ones first; what is left to pace is how many batch requests are put into the
engine at all, since every one of them adds rows to the steps interactive requests share and
holds KV. The pacer reads the engine's queue every tick (additive increase, multiplicative
decrease, as TCP paces a flow to a link it shares):

    requests wait in the core, interactive ones in flight   halve: they may be waiting behind batch work
    requests wait, only batch ones in flight                 one fewer: queueing more batch gains nothing
    nothing waits and the batch fills its allowance          one more, up to the ceiling
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    num_waiting: int  # requests the engine core has not started (all classes)
    num_in_flight: int  # requests the engine is serving, batch lines included


class BatchPacer:
    def __init__(self, read_load: Callable[[], EngineLoad], ceiling: Callable[[], int], start: int = 2) -> None:
        """`ceiling`: the most lines in flight, read every tick (a router's grows with its replicas)."""
        self.read_load = read_load
        self.ceiling = ceiling
        self.limit = max(1, min(start, ceiling()))

    def tick(self, batch_in_flight: int) -> int:
        """The new allowance, given how many batch lines are in flight now."""
        load = self.read_load()
        interactive = load.num_in_flight - batch_in_flight
        if load.num_waiting > 0 and interactive > 0:
            self.limit = max(1, self.limit // 2)
        elif load.num_waiting > 0:
            self.limit = max(1, self.limit - 1)
        elif batch_in_flight >= self.limit:
            self.limit += 1
        self.limit = max(1, min(self.limit, self.ceiling()))
        return self.limit
