"""Waiting requests in rank order, with fair share between the tenants of a class (ranking.py).

    group (priority, slo_class, deadline offset) → tenant → its requests in arrival order

Within a group every member has the same priority and deadline offset, so arrival order IS
rank order there (the oldest has aged the most and is due first); `fair_turns` hands the
group's turns to its tenants, and a lazy k-way merge of the groups yields the global order
without sorting the whole queue each step (the scheduler usually stops after the first few).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Iterator
from operator import itemgetter

from servelm.scheduler.ranking import FairShare, Ranking, RankKey, arrival_key, fair_turns
from servelm.scheduler.request import Request

_GroupKey = tuple[int, str, float]  # (priority, slo_class, deadline offset)


class WaitingQueue:
    def __init__(self, ranking: Ranking, fair_share: FairShare) -> None:
        self.ranking = ranking
        self.fair_share = fair_share  # read only: the Scheduler feeds it
        self._groups: dict[_GroupKey, dict[str, list[Request]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no particular order."""
        for tenants in self._groups.values():
            for members in tenants.values():
                yield from members

    def num_arrived_before(self, cutoff: float) -> int:
        """How many waiting requests arrived before `cutoff` (wall clock): a bisect per tenant list."""
        return sum(
            bisect.bisect_left(members, (cutoff, -1), key=arrival_key)
            for tenants in self._groups.values()
            for members in tenants.values()
        )

    def best_priority(self) -> int | None:
        """The best (lowest) priority among the waiting requests; None when none waits."""
        return min((key[0] for key in self._groups), default=None)

    def _group_key(self, request: Request) -> _GroupKey:
        return (request.priority, request.slo.slo_class, self.ranking.deadline_offset(request))

    def add(self, request: Request) -> None:
        """Insert by arrival: a preempted request goes back ahead of later arrivals."""
        tenants = self._groups.setdefault(self._group_key(request), {})
        bisect.insort(tenants.setdefault(request.slo.tenant, []), request, key=arrival_key)
        self._len += 1

    def remove_many(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        for group_key, tenants in list(self._groups.items()):
            for tenant, members in list(tenants.items()):
                kept = [r for r in members if id(r) not in gone]
                self._len -= len(members) - len(kept)
                if kept:
                    tenants[tenant] = kept
                else:
                    del tenants[tenant]
            if not tenants:
                del self._groups[group_key]

    def ordered(self, now: float) -> Iterator[tuple[RankKey, Request]]:
        """(rank of the turn, request taking it), best first. Do not add or remove while
        iterating; collect, then remove_many."""

        def group_order(key: _GroupKey, tenants: dict[str, list[Request]]) -> Iterator[tuple[RankKey, Request]]:
            for turn, pick in fair_turns(tenants, key[1], self.fair_share):
                yield self.ranking.rank(turn, now), pick

        return heapq.merge(*(group_order(k, t) for k, t in self._groups.items()), key=itemgetter(0))
