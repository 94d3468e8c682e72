from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from servelm.cluster.local import LocalCluster
from servelm.cluster.spec import ClusterConfig, ReplicasConfig, RouterConfig
from servelm.ports import free_port_range
from servelm.testing.tiny_model import write_tiny_checkpoint

ROUTER_KEY = "router-key-1"  # the e2e router's API key (replicas run without one)


@contextlib.contextmanager
def tiny_fleet(
    root: Path, count: int, replica_args: Sequence[str], router_args: Sequence[str], policy: str = "kv"
) -> Iterator[LocalCluster]:
    """`count` replicas of a tiny model (with KV events for the kv policy) and a router, started
    by the cluster launcher under `root`; stopped on exit."""
    kv_events = policy == "kv"
    base = free_port_range(1 + count * (3 if kv_events else 1))
    config = ClusterConfig(
        model=str(write_tiny_checkpoint(root / "model", seed=0)),
        replicas=ReplicasConfig(count=count, num_threads=1, base_port=base + 1,
                                kv_events_base_port=base + 1 + count if kv_events else None, args=tuple(replica_args)),
        router=RouterConfig(port=base, policy=policy, args=("--health-interval", "0.5", *router_args)),
    )  # fmt: skip
    cluster = LocalCluster(config, root / "logs", startup_timeout_s=240)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
