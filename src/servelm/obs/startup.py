"""Where a cold start's time went: each start-up phase with when it began and how long it took.

    fetch        bytes arriving from the origin or peers (a remote --model)
    verify       checking chunks already on disk against the manifest (a resumed or cached pull)
    load         reading tensors into the model, converted to their dtype on their device
    kernel_build compiling (or finding cached) kernels
    warmup       the first forward passes, before the first request pays for them
    kv_sizing    measuring memory and sizing the KV pool

Phases may overlap (a streaming load runs while the fetch does): each is an interval, not a
share of a sum. The engine core records them and sends them with CoreReady; the API server
logs them and exports `servelm:startup_seconds{phase=...}`. While it starts, `on_phase` hears
each phase as it begins (the core forwards it, so the API's /ready can say "starting: load").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PHASES = ("fetch", "verify", "load", "kernel_build", "warmup", "kv_sizing")


@dataclass(frozen=True)
class PhaseRecord:
    name: str  # one of PHASES
    started_at: float  # wall clock (time.time()): comparable across processes
    seconds: float

    @property
    def ended_at(self) -> float:
        return self.started_at + self.seconds


@dataclass
class StartupTimeline:
    records: list[PhaseRecord] = field(default_factory=list)
    # Called with a phase's name as `phase()` enters it, in the thread that enters it (not for `add`,
    # which records a phase already over).
    on_phase: Callable[[str], None] | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (recorded even when it raises: a failed start's log says where)."""
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}; known: {', '.join(PHASES)}")
        if self.on_phase is not None:
            self.on_phase(name)
        started_at, started = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self.add(name, started_at, time.perf_counter() - started)

    def add(self, name: str, started_at: float, seconds: float) -> None:
        """A phase timed elsewhere (a pull's threads)."""
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}; known: {', '.join(PHASES)}")
        self.records.append(PhaseRecord(name, started_at, seconds))
        logger.info("start-up phase %s: %.3f s", name, seconds)

    def seconds_by_phase(self) -> dict[str, float]:
        """Total seconds per phase (a phase recorded twice, e.g. two models' loads, adds up)."""
        totals: dict[str, float] = {}
        for record in self.records:
            totals[record.name] = totals.get(record.name, 0.0) + record.seconds
        return totals
