"""The router's state and its life-cycle operations, apart from HTTP.

    Router ─ replicas (ReplicaSet) ─ policy (+ SessionAffinity) ─ PolicyContext (prefix / kv index)
           └ one KVSubscriber per healthy replica that publishes events

Every change of a replica's standing goes through here, so the indexes never disagree
with rotation: `mark_down` takes a replica out and drops its index entries and event
subscription; `mark_up` puts it back (its KV index resyncs from a snapshot);
`remove_replica` forgets it. All run on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from servelm.kv.block_hash import BlockHash
from servelm.router.disagg import DisaggSettings
from servelm.router.kv_index import KVIndex, KVMatch
from servelm.router.kv_subscriber import KVSubscriber
from servelm.router.metrics import RouterMetrics
from servelm.router.policies import (
    PolicyContext,
    PolicySettings,
    RoutingPolicy,
    SessionAffinity,
    make_policy,
)
from servelm.router.prefix_index import PrefixIndex
from servelm.router.replicas import Replica, ReplicaSet, ReplicaSpec
from servelm.zmq_contexts import non_lingering_async_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterOptions:
    policy: str = "kv"
    block_size: int = 16  # must equal the replicas' --block-size, or no hash will match
    load_metric: str = "requests"
    load_weight: float = 1.0
    capacity: float = 8.0
    host_hit_weight: float = PolicySettings.host_hit_weight  # kv policy: a host-tier block vs a pool block
    disk_hit_weight: float = PolicySettings.disk_hit_weight  # ... a disk-tier block
    session_affinity: bool = False
    prefix_index_blocks: int = 65536  # per replica, prefix policy
    prefix_index_ttl_s: float = 600.0
    kv_index_blocks: int = 1 << 20  # per replica and medium, kv policy (>= the replicas' largest tier, in blocks)
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    max_attempts: int = 2  # the first try, plus one retry on another replica before the first byte
    max_migrations: int = 2  # times a stream may move to another replica after its first byte (0: never)
    upstream_stall_timeout_s: float | None = 60.0  # a migratable stream's replica silent this long is lost (None: never)
    disagg: bool = True  # split long uncached prompts onto prefill workers, when there are any (disagg.py)
    disagg_min_uncached_tokens: int = DisaggSettings.min_uncached_tokens
    disagg_max_prefill_load: int = DisaggSettings.max_prefill_load

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_attempts < 1 or self.health_interval_s <= 0:
            raise ValueError("block_size, max_attempts and health_interval_s must be positive")
        stall = self.upstream_stall_timeout_s
        if self.max_migrations < 0 or (stall is not None and stall <= 0):
            raise ValueError(
                f"max_migrations must be >= 0 and upstream_stall_timeout_s > 0, got {self.max_migrations}, "
                f"{self.upstream_stall_timeout_s}"
            )
        self.policy_settings()  # its own checks, before anything starts
        self.disagg_settings()

    def disagg_settings(self) -> DisaggSettings:
        return DisaggSettings(self.disagg, self.disagg_min_uncached_tokens, self.disagg_max_prefill_load)

    def policy_settings(self) -> PolicySettings:
        return PolicySettings(
            self.load_metric, self.load_weight, self.capacity, self.host_hit_weight, self.disk_hit_weight
        )


class Router:
    def __init__(self, options: RouterOptions) -> None:
        self.options = options
        self.replicas = ReplicaSet()
        settings = options.policy_settings()
        self.context = PolicyContext(
            settings=settings,
            prefix_index=PrefixIndex(options.prefix_index_blocks, options.prefix_index_ttl_s),
            kv_index=KVIndex(options.kv_index_blocks),
        )
        policy = make_policy(options.policy, self.context)
        # Sessions stick unless their replica is at twice the capacity: then the load wins.
        self.policy: RoutingPolicy = (
            SessionAffinity(policy, settings, overload=2 * options.capacity) if options.session_affinity else policy
        )
        self.metrics = RouterMetrics(lambda: self.replicas)
        self._zmq = non_lingering_async_context()
        self._subscribers: dict[str, KVSubscriber] = {}

    def cached_blocks(self, url: str, block_hashes: Sequence[BlockHash]) -> KVMatch:
        """The prompt blocks a replica is known to hold: its KV events (kv), else what the router
        sent it (prefix). What the disaggregation decider weighs; read-only."""
        if self.options.policy == "prefix":
            return KVMatch(device=self.context.prefix_index.match(url, block_hashes))
        return self.context.kv_index.lookup(url, block_hashes)

    def add_replica(self, spec: ReplicaSpec) -> Replica:
        """Register a replica; it joins the rotation once a health check passes."""
        logger.info("replica added: %s (kv events: %s, role: %s)", spec.url, spec.kv_events or "none",
                    spec.role or "as it reports")  # fmt: skip
        return self.replicas.add(spec)

    async def remove_replica(self, url: str) -> bool:
        replica = self.replicas.remove(url)
        if replica is None:
            return False
        await self._forget(replica)
        logger.info("replica removed: %s", replica.url)
        return True

    def mark_up(self, replica: Replica) -> None:
        """In rotation (its KV index resyncs); its last error is history now. Safe to repeat."""
        replica.consecutive_failures = 0
        replica.last_error = ""
        if replica.healthy or self.replicas.get(replica.url) is not replica:
            return
        replica.healthy = True
        replica.out_of_rotation = asyncio.Event()
        logger.info("replica %s is healthy: in rotation", replica.url)
        spec = replica.spec
        if spec.kv_events is not None and spec.snapshot_address is not None:
            subscriber = KVSubscriber(self._zmq, spec.url, spec.kv_events, spec.snapshot_address, self.context.kv_index)
            self._subscribers[spec.url] = subscriber
            subscriber.start()

    async def mark_down(self, replica: Replica, error: str) -> None:
        """Out of rotation, its index entries dropped (its cache is gone or unknown). Safe to repeat."""
        replica.consecutive_failures += 1
        replica.last_error = error
        if not replica.healthy:
            return
        replica.healthy = False
        replica.out_of_rotation.set()  # the requests waiting there for a first byte are retried elsewhere
        logger.warning("replica %s out of rotation: %s", replica.url, error)
        await self._forget(replica)

    async def _forget(self, replica: Replica) -> None:
        subscriber = self._subscribers.pop(replica.url, None)
        if subscriber is not None:
            await subscriber.stop()
        self.context.kv_index.drop_replica(replica.url)
        self.context.prefix_index.drop_replica(replica.url)

    async def close(self) -> None:
        for subscriber in list(self._subscribers.values()):
            await subscriber.stop()
        self._subscribers.clear()
        self._zmq.term()
