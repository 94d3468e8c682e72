"""Routing policies: which replica gets a request.

    RequestView (block hashes, sizes, session) + healthy replicas ──choose()──▶ Decision

Pick one by name from `POLICIES` (`make_policy`); `SessionAffinity` wraps any of them.

Cache-aware scoring (`prefix`, `kv`), per candidate replica r, on its own numbers:

    hit(r)   = (device(r) + host_hit_weight * host(r) + disk_hit_weight * disk(r)) / num_prompt_blocks
    score(r) = hit(r)  -  load_weight * load(r) / capacity

where device / host / disk count the prompt's leading blocks r would take from its pool and
then load from its KV tiers (KVIndex.lookup; `prefix` knows only the pool). The highest score
wins; ties go to the lower load, then to a rendezvous hash of the request's first block, so
cache misses spread over the fleet (a different prefix lands on a different replica) and a
prefix's misses keep landing on the same one. A hot replica loses only the requests whose
cache benefit its load outweighs; affinity stays on everywhere else.

Tier weights: a block's worth is the prefill time it saves. A pool block saves all of it (1.0); a
tier block saves it minus its load (a host-memory copy; a disk read and checksum) and the extra
scheduler round a load costs, so it scores between a pool hit and a miss:

    weight(tier) ≈ (TTFT computed - TTFT from the tier) / (TTFT computed - TTFT from the pool)

Measured on the default model (CPU, 1 thread, 512-token prompt, 31 blocks loaded, 3 runs each):
computed 2.0-2.4 s, pool hit 0.18-0.25 s, host 0.26-0.30 s (2.4 GB/s, 0.2 ms/block), disk (the
page cache) 0.26-0.37 s (0.7 GB/s): weight ~0.99 host, ~0.95 disk. There prefill is slow (~70 ms
per 16-token block), so any load wins. On a GPU prefill is ~100x faster and loads are not: an
8B model on an H100-class GPU prefills a 16-token block (2 MiB of KV) in under a millisecond,
copies it from pinned host memory in ~0.1 ms (weight ~0.85) and reads it from an NVMe disk in
about the time it takes to compute it (weight 0 to ~0.5; estimates, not measured here). The
defaults sit between the two, keep device > host > disk > miss strict, and are flags
(`--kv-host-hit-weight`, `--kv-disk-hit-weight`) for a fleet that measured its own: host 0.9,
disk 0.5.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from servelm.kv.block_hash import BlockHash
from servelm.router.kv_index import KVIndex, KVMatch
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
    # One prompt, n = 1, no prompt scoring (echo + logprobs): its prefill may run on another
    # replica (disagg.py); anything else is served whole where it is routed.
    single_generation: bool = True
    lora_name: str | None = None  # the LoRA adapter its `model` names (None: the base model)


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # round_robin | least_load | prefix_hit | kv_hit | kv_tier_hit | cache_miss | session
    match: KVMatch = KVMatch()  # the prompt blocks the replica was expected to serve, per medium

    @property
    def matched_blocks(self) -> int:
        return self.match.num_blocks


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
    host_hit_weight: float = 0.9  # a block loaded from host memory, relative to a pool hit (module doc)
    disk_hit_weight: float = 0.5  # a block read from disk, relative to a pool hit

    def __post_init__(self) -> None:
        if self.load_metric not in LOAD_METRICS:
            raise ValueError(f"unknown load metric {self.load_metric!r}; valid: {', '.join(LOAD_METRICS)}")
        if self.capacity <= 0 or self.load_weight < 0:
            raise ValueError("capacity must be positive and load_weight non-negative")
        if not 0 <= self.disk_hit_weight <= self.host_hit_weight <= 1:
            raise ValueError(
                "tier weights must satisfy 0 <= disk_hit_weight <= host_hit_weight <= 1 (a nearer tier is never "
                f"worth less), got host {self.host_hit_weight}, disk {self.disk_hit_weight}"
            )

    def hit(self, match: KVMatch) -> float:
        """Prompt blocks `match` saves computing, in pool-hit equivalents."""
        return match.device + self.host_hit_weight * match.host + self.disk_hit_weight * match.disk


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
        self, name: str, settings: PolicySettings, match: Callable[[str, Sequence[BlockHash]], KVMatch],
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
            match = self._match(replica.url, view.block_hashes) if num_blocks else KVMatch()
            load = replica.load(s.load_metric)
            score = (s.hit(match) / num_blocks if num_blocks else 0.0) - s.load_weight * load / s.capacity
            # round(): equal scores must tie exactly, so the load and hash tie-breaks decide.
            scored.append((round(score, 9), -load, rendezvous(view.routing_key, replica.url), match, replica))
        _, _, _, match, best = max(scored, key=lambda t: t[:3])
        if self._record is not None and num_blocks:
            self._record(best.url, view.block_hashes)
        if match.num_tier_blocks:
            reason = f"{self.name}_tier_hit"
        else:
            reason = f"{self.name}_hit" if match.device else "cache_miss"
        return Decision(best, reason, match)


@dataclass
class PolicyContext:
    """The shared state policies may use; the router owns it and drops a replica's entries on failure."""

    settings: PolicySettings = field(default_factory=PolicySettings)
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    kv_index: KVIndex = field(default_factory=KVIndex)


POLICIES: dict[str, Callable[[PolicyContext], RoutingPolicy]] = {
    "round_robin": lambda ctx: RoundRobin(),
    "least_load": lambda ctx: LeastLoad(ctx.settings),
    "prefix": lambda ctx: CacheAware(
        "prefix",
        ctx.settings,
        lambda url, hashes: KVMatch(device=ctx.prefix_index.match(url, hashes)),
        ctx.prefix_index.insert,
    ),
    "kv": lambda ctx: CacheAware("kv", ctx.settings, ctx.kv_index.lookup),
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
