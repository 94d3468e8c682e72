"""The order the scheduler serves requests in: effective priority, deadline, fair share.

Every request has a rank, lower first:

    rank               = (effective priority, deadline, arrival seq)
    effective priority = priority - floor(waited / aging_s)          aging: nothing starves
                         (priority, for a class that does not age: batch lines fill idle capacity)
    deadline           = arrival_time + its class's TTFT target       least slack first

The scheduler ranks with it everywhere: the running list is sorted by rank each step (decodes
go best first; a preemption victim is the worst rank, the most slack) and step 2 merges running
prompts mid-prefill with waiting requests by (effective priority, deadline, 0 running |
1 waiting, arrival seq) (`prefill_order`). Running-first breaks deadline ties only: a realtime
prompt (TTFT 0.3 s) that arrives while a batch prompt (TTFT 30 s) of the same priority
prefills takes the long-prefill slot from it at once, and within one class, where the deadline
order is the arrival order, a running prompt yields only to a request that arrived before it
(one preempted, or skipped while it did not fit), which has the least slack.

No TTFT target: deadline = arrival_time + aging_s. Among untargeted peers that is arrival order,
as before classes. Next to targeted requests aging_s is the right stand-in: it is the latency
the scheduler itself promises an untargeted request (after aging_s it is lifted a class), on the
same scale as a target. An infinite deadline would let a stream of targeted requests of the
same priority starve untargeted ones whenever aging is off; 0 would put every untargeted request
ahead of every targeted one of its priority.

Fair share between tenants of one class (the waiting queue's order, `fair_turns`). Waiting
requests are grouped by (priority, slo_class, deadline offset); a group's members rank in
arrival order among themselves. The group's TURNS come at its members' ranks, in order, so
between groups the order is exactly the rank order above; which request takes a turn is fair
share's choice: the tenant with the least service in that class takes it, with its oldest
request. Service = tokens scheduled for the tenant's requests of the class (prefill and decode),
decayed with a half-life of FAIR_SHARE_HALF_LIFE_S, plus the tokens of its requests already
given a turn in this walk (start-time fair queueing with tokens as the unit), each divided by
the tenant's weight (RequestSlo.weight, from the tenants file): a tenant of weight 2 gets about
twice the tokens of a tenant of weight 1 while both have requests waiting. So a tenant that floods a class gets
turns only as its service falls back to the others', the other tenants' requests go first
meanwhile, and the flood still advances (its service decays while it waits). One tenant alone
gets every turn of its group in arrival order: the order before classes.

Cost: starting a group's walk is O(tenants) and each turn O(log tenants), and the walk is lazy
(the scheduler stops early, as before); update() decays O(active tenant-classes) counters.

Aging still never blocks: running requests rank by their own rank, so scheduler.py's argument
stands (a running request's rank keeps improving until it outranks all later arrivals). A
waiting request's group turns improve with age as its own rank would; a tenant passed over has
its service decaying while the one picked accumulates, so each tenant's oldest request gets a
turn; and admission still tries every waiting request while it is open.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter

from servelm.datatypes import RequestSlo
from servelm.scheduler.request import Request

RankKey = tuple[int, float, int]  # (effective priority, deadline, arrival seq): lower goes first
_PrefillKey = tuple[int, float, int, int]  # (effective priority, deadline, 0 running | 1 waiting, arrival seq)
# Served tokens count half after this long: fair over the last minute or so, while a flood that
# stopped is forgiven rather than held against its tenant for good.
FAIR_SHARE_HALF_LIFE_S = 30.0
_FORGOTTEN_TOKENS = 1e-3  # service decayed below this is dropped: memory stays with active tenants


def arrival_key(request: Request) -> tuple[float, int]:
    """Arrival order; the seq breaks ties between equal arrival times."""
    return (request.arrival_time, request.arrival_seq)


@dataclass(frozen=True)
class Ranking:
    aging_s: float  # 0: no aging

    def effective_priority(self, request: Request, now: float) -> int:
        if self.aging_s <= 0 or not request.slo.ages:
            return request.priority
        waited = max(0.0, now - request.arrival_time)  # clamp: another host's clock may run ahead
        return request.priority - math.floor(waited / self.aging_s)

    def deadline_offset(self, request: Request) -> float:
        """Seconds after arrival its first token is due: its class's TTFT target, else aging_s."""
        target = request.slo.ttft_target_s
        return self.aging_s if target is None else target

    def rank(self, request: Request, now: float) -> RankKey:
        deadline = request.arrival_time + self.deadline_offset(request)
        return (self.effective_priority(request, now), deadline, request.arrival_seq)


@dataclass
class FairShare:
    """Decayed tokens served per (slo_class, tenant). Fed by Scheduler.update(), read by fair_turns."""

    half_life_s: float = FAIR_SHARE_HALF_LIFE_S
    _served: dict[tuple[str, str], float] = field(default_factory=dict)
    _decayed_at: float | None = None

    def decay(self, now: float) -> None:
        """Age every tenant's service to `now`; forget those decayed to nothing. Call once a step."""
        if self._decayed_at is not None and now > self._decayed_at:
            factor = 0.5 ** ((now - self._decayed_at) / self.half_life_s)
            self._served = {k: v * factor for k, v in self._served.items() if v * factor >= _FORGOTTEN_TOKENS}
        self._decayed_at = now if self._decayed_at is None else max(self._decayed_at, now)

    def add(self, slo: RequestSlo, num_tokens: int) -> None:
        key = (slo.slo_class, slo.tenant)
        self._served[key] = self._served.get(key, 0.0) + weighted_service(slo, num_tokens)

    def served(self, slo_class: str, tenant: str) -> float:
        return self._served.get((slo_class, tenant), 0.0)


def weighted_service(slo: RequestSlo, num_tokens: int) -> float:
    """Service counted against a tenant: its tokens over its weight (weights are > 0: the tenants
    file rejects others; a non-positive one from elsewhere counts as 1 rather than dividing by 0)."""
    return num_tokens / slo.weight if slo.weight > 0 else float(num_tokens)


def fair_turns(
    members_by_tenant: Mapping[str, list[Request]], slo_class: str, fair_share: FairShare
) -> Iterator[tuple[Request, Request]]:
    """One group's (turn, pick) pairs, best turn first: `turn` is the member whose rank the turn
    carries (the group's members in arrival order), `pick` the request that takes it (the least
    served tenant's oldest). Each list must be one tenant's members in arrival order, unchanged
    while the iterator runs."""
    turns = heapq.merge(*members_by_tenant.values(), key=arrival_key)
    # (service, its next request's arrival, tenant, index of that request): ties go to the oldest.
    heads = [
        (fair_share.served(slo_class, tenant), arrival_key(members[0]), tenant, 0)
        for tenant, members in members_by_tenant.items()
        if members
    ]
    heapq.heapify(heads)
    for turn in turns:
        service, _, tenant, index = heapq.heappop(heads)
        members = members_by_tenant[tenant]
        pick = members[index]
        if index + 1 < len(members):
            heapq.heappush(heads, (service + weighted_service(pick.slo, pick.num_tokens), arrival_key(members[index + 1]), tenant, index + 1))
        yield turn, pick


def prefill_order(
    prefilling: Iterable[Request], waiting: Iterator[tuple[RankKey, Request]], ranking: Ranking, now: float
) -> Iterator[tuple[bool, Request]]:
    """Step 2's order: running prompts mid-prefill (in rank order) merged with the waiting
    queue's (rank, request) order by (effective priority, deadline, running first, seq).
    Yields (is_waiting, request)."""

    def keyed(pairs: Iterable[tuple[RankKey, Request]], is_waiting: int) -> Iterator[tuple[_PrefillKey, Request]]:
        for (priority, deadline, seq), request in pairs:
            yield (priority, deadline, is_waiting, seq), request

    running = ((ranking.rank(r, now), r) for r in prefilling)
    for key, request in heapq.merge(keyed(running, 0), keyed(waiting, 1), key=itemgetter(0)):
        yield bool(key[2]), request
