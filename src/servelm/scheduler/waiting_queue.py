"""Waiting requests in (effective priority, arrival) order, with aging.

    effective priority = priority - floor(waited / aging_s)

One list per priority class, each sorted by arrival. Within a class the oldest request
has aged the most, so arrival order IS effective-priority order there; a lazy k-way
merge of the classes then yields the global order without sorting the whole queue
each step (the scheduler usually stops after the first few).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Iterator

from servelm.scheduler.request import Request


def _arrival_key(request: Request) -> tuple[float, int]:
    return (request.arrival_time, request.arrival_seq)


class WaitingQueue:
    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s  # 0: no aging
        self._classes: dict[int, list[Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no particular order."""
        for requests in self._classes.values():
            yield from requests

    def add(self, request: Request) -> None:
        """Insert by arrival: a preempted request goes back ahead of later arrivals."""
        bisect.insort(self._classes.setdefault(request.priority, []), request, key=_arrival_key)
        self._len += 1

    def remove(self, request: Request) -> None:
        self.remove_many([request])

    def remove_many(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        for priority, members in list(self._classes.items()):
            kept = [r for r in members if id(r) not in gone]
            self._len -= len(members) - len(kept)
            if kept:
                self._classes[priority] = kept
            else:
                del self._classes[priority]

    def effective_priority(self, request: Request, now: float) -> int:
        if self.aging_s <= 0:
            return request.priority
        waited = max(0.0, now - request.arrival_time)  # clamp: another host's clock may run ahead
        return request.priority - math.floor(waited / self.aging_s)

    def rank(self, request: Request, now: float) -> tuple[int, float, int]:
        """(effective priority, arrival): lower goes first. The scheduler ranks running requests
        by it too, so an aged request also stops being the first preemption victim."""
        return (self.effective_priority(request, now), request.arrival_time, request.arrival_seq)

    def ordered(self, now: float) -> Iterator[Request]:
        """Best first. Do not add or remove while iterating; collect, then remove_many."""
        return heapq.merge(*self._classes.values(), key=lambda request: self.rank(request, now))
