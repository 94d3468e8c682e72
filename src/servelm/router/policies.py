"""Routing policies: which replica gets a request.

    RequestView (block hashes, sizes, session) + healthy replicas ──choose()──▶ Decision

Pick one by name from `POLICIES` (`make_policy`); `SessionAffinity` wraps any of them.

Cache-aware scoring (`prefix`, `kv`), per candidate replica r, on its own numbers:

    score(r) = matched_blocks(r) / num_prompt_blocks  -  load_weight * load(r) / capacity

then the highest score wins; ties go to the lower load, then to a rendezvous hash of
the request's first block, so cache misses spread over the fleet (a different prefix
lands on a different replica) and a prefix's misses keep landing on the same one. A hot
replica loses only the requests whose cache benefit its load outweighs; affinity stays
on everywhere else.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from servelm.kv.block_hash import BlockHash
from servelm.router.kv_index import KVIndex
from servelm.router.prefix_index import PrefixIndex
from servelm.router.replicas import Replica

LOAD_METRICS = ("requests", "tokens")


@dataclass(frozen=True)
class RequestView:
    """What a policy may look at: never the body itself."""

    block_hashes: Sequence[BlockHash]  # the prompt's full blocks, engine hash function
    num_prompt_tokens: int
    num_output_tokens: int = 0  # max_tokens, when given
    session_id: str | None = None  # x-session-id header or the body's `user`
    routing_key: bytes = b""  # stable per prefix: spreads misses (first block hash, else the prompt's hash)


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # round_robin | least_load | prefix_hit | kv_hit | cache_miss | session
    matched_blocks: int = 0


class RoutingPolicy(Protocol):
    """Chooses a replica. Called by the proxy, on the router's event loop, once per attempt.

    `replicas` is non-empty and holds only candidates (healthy, not excluded by a failed
    attempt). `choose` may update the policy's own state as if the request went to the
    chosen replica (the round-robin cursor, the prefix index); it never changes the replicas.
    """

    name: str

    def choose(self, view: RequestView, replicas: Sequence[Replica]) -> Decision: ...


@dataclass
class PolicySettings:
    load_metric: str = "requests"  # requests | tokens
    load_weight: float = 1.0  # how much of a full cache hit one replica-capacity of load cancels
    capacity: float = 8.0  # load that counts as "full" (requests, or tokens with load_metric=tokens)

    def __post_init__(self) -> None:
        if self.load_metric not in LOAD_METRICS:
            raise ValueError(f"unknown load metric {self.load_metric!r}; valid: {', '.join(LOAD_METRICS)}")
        if self.capacity <= 0 or self.load_weight < 0:
            raise ValueError("capacity must be positive and load_weight non-negative")


def rendezvous(routing_key: bytes, url: str) -> int:
    """Highest-random-weight hash: stable per (key, replica), independent of the other replicas."""
    return int.from_bytes(hashlib.blake2b(routing_key + url.encode(), digest_size=8).digest(), "little")


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, view: RequestView, replicas: Sequence[Replica]) -> Decision:
        return Decision(replicas[next(self._counter) % len(replicas)], "round_robin")


class LeastLoad:
    name = "least_load"

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings

    def choose(self, view: RequestView, replicas: Sequence[Replica]) -> Decision:
        metric = self.settings.load_metric
        best = min(replicas, key=lambda r: (r.load(metric), -rendezvous(view.routing_key, r.url)))
        return Decision(best, "least_load")


class CacheAware:
    """Shared scoring of `prefix` and `kv`; they differ only in where matches come from."""

    def __init__(
        self, name: str, settings: PolicySettings, match: Callable[[str, Sequence[BlockHash]], int],
        record: Callable[[str, Sequence[BlockHash]], None] | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.settings = settings
        self._match = match
        self._record = record  # prefix: remember what we sent where; kv: the replica tells us

    def choose(self, view: RequestView, replicas: Sequence[Replica]) -> Decision:
        s = self.settings
        num_blocks = len(view.block_hashes)
        scored = []
        for replica in replicas:
            matched = self._match(replica.url, view.block_hashes) if num_blocks else 0
            load = replica.load(s.load_metric)
            score = (matched / num_blocks if num_blocks else 0.0) - s.load_weight * load / s.capacity
            # round(): equal scores must tie exactly, so the load and hash tie-breaks decide.
            scored.append((round(score, 9), -load, rendezvous(view.routing_key, replica.url), matched, replica))
        _, _, _, matched, best = max(scored, key=lambda t: t[:3])
        if self._record is not None and num_blocks:
            self._record(best.url, view.block_hashes)
        reason = f"{self.name}_hit" if matched else "cache_miss"
        return Decision(best, reason, matched)


@dataclass
class PolicyContext:
    """The shared state policies may use; the router owns it and drops a replica's entries on failure."""

    settings: PolicySettings = field(default_factory=PolicySettings)
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    kv_index: KVIndex = field(default_factory=KVIndex)


POLICIES: dict[str, Callable[[PolicyContext], RoutingPolicy]] = {
    "round_robin": lambda ctx: RoundRobin(),
    "least_load": lambda ctx: LeastLoad(ctx.settings),
    "prefix": lambda ctx: CacheAware("prefix", ctx.settings, ctx.prefix_index.match, ctx.prefix_index.insert),
    "kv": lambda ctx: CacheAware("kv", ctx.settings, ctx.kv_index.match),
}


def make_policy(name: str, ctx: PolicyContext) -> RoutingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(POLICIES)}") from None
    return factory(ctx)


class SessionAffinity:
    """Keeps a session on the replica it started on, while that replica is a candidate and not overloaded.

    Sessions with no replica yet (or whose replica is gone or at `overload` load) get the
    inner policy's choice, which becomes their replica. At most `max_sessions` are
    remembered (least recently used dropped).
    """

    def __init__(self, inner: RoutingPolicy, settings: PolicySettings, overload: float, max_sessions: int = 100_000):
        self.inner = inner
        self.name = inner.name
        self.settings = settings
        self.overload = overload
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def choose(self, view: RequestView, replicas: Sequence[Replica]) -> Decision:
        if view.session_id is None:
            return self.inner.choose(view, replicas)
        url = self._sessions.get(view.session_id)
        for replica in replicas:
            if replica.url == url and replica.load(self.settings.load_metric) < self.overload:
                self._sessions.move_to_end(view.session_id)
                return Decision(replica, "session")
        decision = self.inner.choose(view, replicas)
        self._sessions[view.session_id] = decision.replica.url
        self._sessions.move_to_end(view.session_id)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return decision

    def num_sessions(self) -> int:
        return len(self._sessions)
